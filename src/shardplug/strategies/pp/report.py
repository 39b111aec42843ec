"""pp's account of its share of a step, for explain: stages, microbatches, repeats and
bubble, the layer stack's bytes, which layers each stage holds, and the schedule's
collective-permute traffic as compiled against its own figure."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardplug.plugin import KINDS, Table
from shardplug.strategies.pp.stages import Pipeline, circular_order

F, B = KINDS["F"], KINDS["B"]


def pipeline_report(axis: str, mesh: Any, step: Any) -> dict[str, Any] | None:
    """The schedule's figures (see the module), read from the traced program; None when the
    step runs no schedule over ``axis``. One send forward and one back per tick, each a
    microbatch's stage input per device; the circular schedule also moves the stack's
    shards into its order (and their gradients back): the difference."""
    found_schedule = schedule_of(step.jaxpr)
    if found_schedule is None or found_schedule[0] != axis:
        return None
    _, ticks, inputs = found_schedule
    n_micro, n_stages = inputs.shape[0], mesh.shape[axis]
    n_repeats = (ticks - n_stages + 1) // n_micro
    pl = Pipeline(axis, n_stages, n_micro, n_repeats)
    stacked = _stage_split(step, axis)
    if not stacked:
        return None
    shape, dtype = (inputs.shape[0] * inputs.shape[1], *inputs.shape[2:]), inputs.dtype
    batch_axes = step.batch_axes
    shards = math.prod(mesh.shape[a] for a in batch_axes) if batch_axes else 1
    send = shape[0] // n_micro // shards * math.prod(shape[1:]) * np.dtype(dtype).itemsize
    permutes = [c for c in step.collectives if c["kind"] == "collective-permute"]
    compiled = sum(c["bytes"] for c in permutes)
    return {
        "schedule": "gpipe",
        "stages": n_stages,
        "microbatches": n_micro,
        "repeats": n_repeats,
        "bubble": pl.bubble,
        "formula": pl.bubble,
        "peak_microbatches": [float(n_micro)]
        * n_stages,  # every microbatch's stage inputs, until B
        **_stack_figures(stacked, mesh, n_stages, n_repeats),
        "ticks": pl.ticks,
        "collective_permute": {
            "compiled_ops": sum(c["count"] for c in permutes),
            "compiled_bytes_per_step": compiled,
            "schedule_ops": 2 * pl.ticks,
            "textbook_bytes_per_step": 2 * send * pl.ticks,
        },
    }


def written_report(table: Table, formula: float, axis: str, mesh: Any,
                   step: Any) -> dict[str, Any] | None:  # fmt: skip
    """The figures of a schedule written into the step (:mod:`shardplug.strategies.pp.ticks`), from
    the table it ran: its bubble as the stages' idle ticks against its authors' formula, the
    microbatches' residuals each stage holds at most, the buffers it keeps, and its
    collective-permutes: one to the stage after and one to the stage before on each tick where
    some stage sends that way."""
    stacked = _stage_split(step, axis)
    if not stacked:
        return None
    n_stages, n_local, n_micro = table.stages, table.chunks, table.microbatches
    forward = int(table.sending["after"].sum())
    backward = int(table.sending["before"].sum())
    permutes = [c for c in step.collectives if c["kind"] == "collective-permute"]
    return {
        "schedule": table.name,
        "stages": n_stages,
        "microbatches": n_micro,
        "repeats": n_local,
        "bubble": table.bubble,
        "formula": formula,
        "idle_ticks": table.idle.tolist(),
        "peak_microbatches": table.peak,
        "slots": table.slots,
        **_stack_figures(stacked, mesh, n_stages, n_local, table.stage_chunks),
        "ticks": table.ticks,
        "compiled_ticks": tick_loop(step.jaxpr),
        "chart": table.chart(),
        "collective_permute": {
            "compiled_ops": sum(c["count"] for c in permutes),
            "compiled_bytes_per_step": sum(c["bytes"] for c in permutes),
            "schedule_ops": forward + backward,
            "sending_ticks": {"forward": forward, "backward": backward},
        },
    }


def tick_loop(jaxpr: Any) -> int | None:
    """The length of the traced step's tick loop: the scan whose body enters the stages'
    manual region (a ``shard_map`` that sends with ``ppermute``); None without one."""

    def subs(eqn):
        for value in eqn.params.values():
            for v in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield inner

    def has(jaxpr, name, inside=None):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == name and (inside is None or any(
                    has(sub, inside) for sub in subs(eqn))):  # fmt: skip
                return True
            if any(has(sub, name, inside) for sub in subs(eqn)):
                return True
        return False

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan" and any(
                has(sub, "shard_map", "ppermute") for sub in subs(eqn)
            ):
                return int(eqn.params["length"])
            for sub in subs(eqn):
                if (found := find(sub)) is not None:
                    return found
        return None

    return find(getattr(jaxpr, "jaxpr", jaxpr))


def _stage_split(step: Any, axis: str) -> list[tuple[Any, Any]]:
    """The layer stack's parameters (and stored specs): those split over ``axis``."""
    return [(leaf, spec) for leaf, spec in zip(step.params, step.stored, strict=True)
            if len(spec) and spec[0] == axis]  # fmt: skip


def _stack_figures(stacked: list, mesh: Any, stages: int, chunks: int,
                   placed: list[list[int]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The stack's layers, which each stage holds (``placed``: each stage's chunks, where a
    schedule places them; else circular), and its bytes whole and per device."""
    layers = stacked[0][0].shape[0]
    size = layers // (stages * chunks)
    held = (
        circular_order(layers, stages, chunks).reshape(stages, -1).tolist()
        if placed is None
        else [[c * size + i for c in mine for i in range(size)] for mine in placed]
    )
    return {
        "layers": layers,
        "stage_layers": held,
        "stack_bytes": sum(_bytes(leaf) for leaf, _ in stacked),
        "stack_bytes_per_device": sum(_bytes(leaf, spec, mesh) for leaf, spec in stacked),
    }


def _bytes(leaf: Any, spec: Any = None, mesh: Any = None) -> int:
    """A parameter's bytes, whole or (with its spec) per device."""
    shape = list(leaf.shape)
    for dim, entry in enumerate(spec or ()):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        shape[dim] //= math.prod(mesh.shape[a] for a in axes)
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def schedule_of(jaxpr: Any) -> tuple[str, int, Any] | None:
    """A pipeline schedule as the traced step runs it: its stage axis, its ticks (the loop
    with a ``ppermute`` inside a ``shard_map``) and its stacked microbatch inputs (the
    ``shard_map``'s last operand: microbatches x rows x ...); None without one.

    Read from the program, not from the plugin: nothing is recorded while it is traced."""

    def subs(eqn):
        for value in eqn.params.values():
            for v in value if isinstance(value, tuple) else (value,):
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield inner

    def permute_axis(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ppermute":
                names = eqn.params["axis_name"]
                return names[0] if isinstance(names, tuple) else names
            for sub in subs(eqn):
                if (found := permute_axis(sub)) is not None:
                    return found
        return None

    def tick_loop(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                body = eqn.params["jaxpr"]
                if (axis := permute_axis(getattr(body, "jaxpr", body))) is not None:
                    return axis, int(eqn.params["length"])
            for sub in subs(eqn):
                if (found := tick_loop(sub)) is not None:
                    return found
        return None

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                body = eqn.params["jaxpr"]
                if (found := tick_loop(getattr(body, "jaxpr", body))) is not None:
                    return (*found, eqn.invars[-1].aval)
            for sub in subs(eqn):
                if (found := walk(sub)) is not None:
                    return found
        return None

    return walk(getattr(jaxpr, "jaxpr", jaxpr))
