"""What a strategy costs, read off its compiled step before a single step runs.

:func:`explain` compiles a trainer's step for a batch and reports where every parameter
lives, the bytes each device holds (parameters, optimizer state, gradients, and the
temporaries of the compiled program's own memory analysis), and the collectives the program
runs, next to the textbook figures for the strategy's layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardplug.core.compiled.facts import Explained, StepFacts
from shardplug.core.compiled.hlo import collectives
from shardplug.core.compiled.targets import compile_noting, memory_of
from shardplug.core.compose import order
from shardplug.core.devices import is_compile_only
from shardplug.core.flops import float32_note, product_dtypes
from shardplug.core.memory import peak_bytes
from shardplug.core.sharding import leading_axes, leaf_paths, mesh_axes
from shardplug.core.step import PRECISIONS
from shardplug.errors import ConfigError, PluginError
from shardplug.loop.feed import global_struct
from shardplug.planning.explain_collectives import tensor_parallel_notes, textbook_and_parts
from shardplug.planning.explain_memory import (  # fmt: skip
    brought_for_update,
    host_memory_notes,
    per_device_bytes,
    shard_bytes,
)
from shardplug.planning.explain_time import predicted
from shardplug.running.native import sorted_stderr


@dataclasses.dataclass(frozen=True)
class ParamReport:
    """One parameter: where it lives and what a device holds of it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int
    replicated: bool
    why: str | None  # why a parameter is whole on every device of a multi-device mesh
    #: who chose the layout: "model" (its annotation names the run's mesh axes), "model,
    #: stored split by fsdp" (a parallelism stores it split further, gathered at use), or
    #: the strategy's name
    placed_by: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`explain` found; ``to_dict()`` is the JSON that ``shardplug explain`` prints."""

    strategy: str
    devices: int
    mesh: dict[str, int]
    platform: str
    params: list[ParamReport]
    per_device: dict[str, int | None]
    collectives: list[dict[str, Any]]
    textbook: list[dict[str, Any]]
    batch: list[dict[str, Any]]
    compile_seconds: float | None
    #: how the first batch leaf and one parameter are split: ``{"name", "shape", "spec",
    #: "dims", "blocks": [[[row0, row1], [col0, col1], [device ids]], ...]}``
    pictures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: where the compiled program and the textbook part ways, and why
    notes: list[str] = dataclasses.field(default_factory=list)
    #: a pipeline run's schedule, stack bytes and permute traffic (its parallelism's report
    #: named "pipeline")
    pipeline: dict[str, Any] | None = None
    #: ``{"compute", "matmul_flops_by_dtype", "float32_sites"}``: the dtypes the step's
    #: matrix products compute in, and where products of float32 operands are
    precision: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``{"types": "auto" | "explicit", "why": ...}``: the mesh's axis types and why
    axis_types: dict[str, str] = dataclasses.field(default_factory=dict)
    #: a split sequence's axes, positions per device and ring traffic (its parallelism's
    #: report named "sequence")
    sequence: dict[str, Any] | None = None
    #: what each parallelism reported of its share (``explain_step``), by the name it gave
    parallelisms: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: a composition's orders (``shardplug.core.compose.order``): ``mesh`` (its axes,
    #: outermost first) and ``claims`` (the order they claim parameter dimensions in)
    order: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: gradients the compiled step all-reduces in parts, one per use of a parameter used
    #: more than once (a tied embedding): ``{"params": [paths], "dims", "parts",
    #: "extra_bytes", "extra_wire_bytes"}`` (:func:`shardplug.core.compiled.hlo.gradient_parts`)
    gradient_parts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the step's time predicted for the GPU it is compiled for (``--target``, or a GPU
    #: present), its throughput, MFU and parts (:func:`shardplug.planning.explain_time.predicted`);
    #: None on other devices
    timing: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["params"] = [dict(dataclasses.asdict(p), shape=list(p.shape)) for p in self.params]
        return out

    def collective_bytes(self, kind: str | None = None) -> int:
        """Bytes of the step's collectives (of one kind), per device."""
        return sum(c["bytes"] for c in self.collectives if kind in (None, c["kind"]))

    def wire_bytes(self) -> int:
        """Bytes each device sends per step for the collectives (ring algorithms)."""
        return sum(c["wire_bytes"] for c in self.collectives)

    def textbook_bytes(self, kind: str | None = None) -> int:
        return sum(t["bytes"] for t in self.textbook if kind in (None, t["kind"]))

    def textbook_wire_bytes(self) -> int:
        return sum(t["wire_bytes"] for t in self.textbook)

    def parts_wire_bytes(self) -> int:
        """What each device sends for the gradient parts a compiler that adds them first
        (XLA's for GPUs) would not reduce apart: the second part of a tied embedding's."""
        return sum(g["extra_wire_bytes"] for g in self.gradient_parts)


def _batch_axes(batch_shardings: Any) -> tuple[str, ...]:
    for sharding in jax.tree.leaves(batch_shardings):
        if leading_axes(sharding.spec):
            return leading_axes(sharding.spec)
    return ()


def _why(strategy: Any, shape: tuple[int, ...], logical: Any, mesh: Any, seen: dict) -> str:
    """Why a parameter stayed whole on a mesh of many devices, from what can be seen:
    ``seen`` holds the smallest split parameter's size and the logical names split anywhere."""
    if seen["smallest"] is None:
        return f"{strategy.name} keeps every parameter whole on every device"
    sizes = sorted({n for n in mesh.shape.values() if n > 1})
    if not any(d % n == 0 for d in shape for n in sizes):
        return f"no dimension of {shape} divides a mesh axis of size {' or '.join(map(str, sizes))}"
    names = [n for n in (logical or ()) if n is not None]
    if names and not set(names) & seen["names"]:
        return f"the rule splits none of its logical axes {tuple(logical)}"
    if math.prod(shape) < seen["smallest"]:
        return (
            f"small: {math.prod(shape)} elements (< {seen['smallest']}, the smallest split)"
        )
    if logical is not None and not names:
        return "no logical-axis annotation to split it by"
    return "the strategy's rule left it whole"


def _placed_by(strategy: Any, logical: Any, spec: Any, mesh: Any) -> str:
    """Whether the model's annotation (mesh axis names) or the strategy placed a parameter."""
    axes = set(mesh.axis_names)
    named = {a for e in (logical or ()) for a in (e if isinstance(e, tuple) else (e,)) if a in axes}
    if not named:
        return strategy.name
    more = sorted(set(mesh_axes(spec)) - named)
    if not more:
        return "model"
    composition = strategy.composition
    parts = [p.name for p in composition.parts if p.axis.name in more] if composition else []
    return f"model, stored split by {', '.join(parts or more)}"


def explain(
    trainer: Any, batch: Any, device_memory: int | None = None, param: str | None = None
) -> Report:
    """Compile ``trainer``'s step for batches like ``batch`` (if not yet) and report its costs.

    :param device_memory: the device's memory in bytes, to compare the peak against; the
        backend's own figure when it gives one (GPUs do; CPUs do not).
    :param param: the path of the parameter to picture (default: the largest).
    :raises ConfigError: when ``param`` names no parameter.
    """
    state, shardings, mesh = trainer.state, trainer.state_shardings, trainer.mesh
    paths = leaf_paths(state.params)
    if param is not None and param not in paths:  # before compiling: a typo costs nothing
        raise ConfigError(f"no parameter {param!r}; the parameters are: {', '.join(paths)}")
    with sorted_stderr(trainer.strategy.name):  # XLA's own lines, said in one of ours
        target_notes = compile_noting(trainer, batch)  # for a GPU not here: what it is
    flat_params = jax.tree.leaves(state.params)
    params = _param_reports(trainer, paths)

    analysis = trainer.compiled.memory_analysis()
    hlo_text = trainer.compiled.as_text()
    trains = trainer.adapter.trainable(state.params)  # None: every parameter
    trains = [True] * len(flat_params) if trains is None else jax.tree.leaves(trains)
    device = mesh.devices.flat[0]
    from_backend = device_memory is None
    if from_backend:
        device_memory = backend_memory(device) or memory_of(device)
    per_device = per_device_bytes(trainer, batch, trains, analysis, hlo_text, device_memory)
    found = [dataclasses.asdict(c) for c in collectives(hlo_text)]
    batch_axes = _batch_axes(trainer.batch_shardings)
    batch_info = _batch_rows(trainer, batch)
    pictures = _pictures(trainer, batch_info, params, param)
    composition = trainer.strategy.composition
    stored = [x.spec for x in jax.tree.leaves(shardings.params)]
    used = (composition and composition.used_specs(state.params, mesh)) or stored
    notes: list[str] = [*target_notes, *tensor_parallel_notes(used, mesh, batch_axes)]
    brought = brought_for_update(trainer, shardings, state, mesh)
    per_device["update_bytes"] = brought
    notes += host_memory_notes(trainer, device.platform, brought)
    peak = per_device["peak_bytes"]
    if from_backend and device_memory and peak and peak > device_memory:
        notes.append(memory_limit_note(device))
    precision, note = _precision(trainer)
    notes += [n for n in (note, _held_note(trainer, precision)) if n]
    textbook, parts, sent = textbook_and_parts(
        hlo_text, found, flat_params, paths, trains,
        shards=[p.bytes_per_device for p in params], stored=stored, used=used, mesh=mesh,
        batch_axes=batch_axes,
    )  # fmt: skip
    notes += sent
    told, reports = _parallelisms_told(trainer, batch, found, paths, stored, used, batch_axes)
    notes += told
    return Report(
        strategy=trainer.strategy.name,
        devices=int(mesh.size),
        mesh={str(k): int(v) for k, v in mesh.shape.items()},
        platform=device.platform,
        params=params,
        per_device=per_device,
        collectives=found,
        textbook=textbook,
        batch=batch_info,
        compile_seconds=trainer.compile_seconds,
        pictures=pictures,
        notes=notes,
        pipeline=reports.get("pipeline"),
        sequence=reports.get("sequence"),
        parallelisms=reports,
        order=order(composition.parts) if composition is not None else {},
        gradient_parts=parts,
        axis_types={"types": trainer.axis_types, "why": trainer.axis_types_reason},
        precision=precision,
        timing=predicted(trainer, batch),
    )


def _param_reports(trainer: Any, paths: list[str]) -> list[ParamReport]:
    """Each parameter's layout and bytes per device, and why one stayed whole where it did."""
    state, shardings, mesh = trainer.state, trainer.state_shardings, trainer.mesh
    flat_params = jax.tree.leaves(state.params)
    flat_shardings = jax.tree.leaves(shardings.params)
    pairs = zip(flat_params, flat_shardings, strict=True)
    whole = [s.shard_shape(p.shape) == p.shape for p, s in pairs]
    logical = (
        [None] * len(flat_params)
        if trainer.annotations is None
        else jax.tree.leaves(
            trainer.annotations, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        )
    )
    split_sizes, split_names = [], set()
    for p, s, names, replicated in zip(flat_params, flat_shardings, logical, whole, strict=True):
        if not replicated:
            split_sizes.append(math.prod(p.shape))
            spec = tuple(s.spec) + (None,) * p.ndim
            split_names |= {n for n, e in zip(names or (), spec, strict=False) if e is not None}
    seen = {"smallest": min(split_sizes) if split_sizes else None, "names": split_names}
    params = []
    for path, p, s, names, replicated in zip(
        paths, flat_params, flat_shardings, logical, whole, strict=True
    ):
        why = None
        if replicated and mesh.size > 1:
            why = _why(trainer.strategy, tuple(p.shape), names, mesh, seen)
        params.append(
            ParamReport(
                path, tuple(p.shape), str(p.dtype), str(s.spec), shard_bytes(p, s), replicated,
                why, _placed_by(trainer.strategy, names, s.spec, mesh),
            )
        )  # fmt: skip
    return params


def _batch_rows(trainer: Any, batch: Any) -> list[dict[str, Any]]:
    """Each batch leaf's path, global shape, spec and rows per device (None for a scalar)."""
    return [
        {
            "path": path or "batch",
            "shape": list(global_struct(x).shape),
            "spec": str(s.spec),
            "rows_per_device": s.shard_shape(global_struct(x).shape)[0] if np.ndim(x) else None,
        }
        for path, x, s in zip(
            leaf_paths(batch),
            jax.tree.leaves(batch),
            jax.tree.leaves(trainer.batch_shardings),
            strict=True,
        )
    ]


def _pictures(
    trainer: Any, batch_info: list[dict[str, Any]], params: list[ParamReport], param: str | None
) -> list[dict[str, Any]]:
    """The pictures of how the first batch leaf and parameter ``param`` (default: the
    largest) are split."""
    if param is None:
        param = max(params, key=lambda p: math.prod(p.shape)).path
    chosen = [p.path for p in params].index(param)
    spec = jax.tree.leaves(trainer.state_shardings.params)[chosen].spec
    return [
        _picture(batch_info[0]["path"], tuple(batch_info[0]["shape"]),
                 jax.tree.leaves(trainer.batch_shardings)[0]),
        _picture(param, params[chosen].shape, NamedSharding(trainer.mesh, spec)),
    ]  # fmt: skip


def _precision(trainer: Any) -> tuple[dict[str, Any], str | None]:
    """The report's ``precision``: the dtypes the step's matrix products compute in; and, in
    a bf16 run, the note on the products that compute in float32."""
    dtypes = product_dtypes(trainer.jaxpr)
    bf16 = PRECISIONS.get(trainer.precision) is not None
    precision = {
        "compute": "bfloat16" if bf16 else "float32",
        "matmul_flops_by_dtype": dtypes.flops,
        "float32_sites": [{"where": w, "flops": f} for w, f in dtypes.float32_sites[:5]],
    }
    return precision, float32_note(dtypes) if bf16 else None


def _held_note(trainer: Any, precision: dict[str, Any]) -> str | None:
    """The weights whose products an add-on runs its own way (float8's), named in
    ``precision["held"]`` by kind, and said with their share of the matrix-product FLOPs."""
    holds = trainer.strategy.held_weights(trainer.state.params, trainer.mesh, trainer.roles)
    if not holds:
        return None
    kinds: dict[str, list[str]] = {}
    for h in holds:
        if h is not None:
            kinds.setdefault(h.kind, []).append(h.path)
    precision["held"] = kinds
    flops = precision["matmul_flops_by_dtype"]
    lines = []
    for kind, paths in kinds.items():
        share = sum(v for k, v in flops.items() if kind in k) / (sum(flops.values()) or 1)
        named = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        lines.append(f"{kind}: {len(paths)} weights held ({named}); {share:.0%} of the "
                     f"step's matrix-product FLOPs run in {kind}{_left(trainer.roles, paths)}")
    return "; ".join(lines)


def _left(roles: Any, held: list[str]) -> str:
    """The weights of a product left as they were, and their roles in the step (the head,
    an embedding, a router, ...: why a default took them not)."""
    if not roles:
        return ""
    left: dict[str, list[str]] = {}
    for path, role in roles.items():
        if path not in held and role.kind not in ("linear", "elementwise"):
            left.setdefault(role.kind, []).append(path)
    if not left:
        return ""
    said = "; ".join(f"{', '.join(p[:3])}{' and more' if len(p) > 3 else ''} ({kind})"
                     for kind, p in left.items())  # fmt: skip
    return f"; left as they were, by their use in the traced step: {said}"


def _parallelisms_told(trainer: Any, batch: Any, found: list[dict[str, Any]], paths: list[str],
                       stored: list[Any], used: list[Any], batch_axes: tuple[str, ...],
                       ) -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """What each parallelism of a composition says of its share of the step (its
    ``explain_step``): its notes, and its reports by the names it gave them.

    :param found: the compiled step's collectives; ``stored`` and ``used``: each
        parameter's spec as stored and where it is used.
    :raises PluginError: when a parallelism returns something other than an Explained.
    """
    notes: list[str] = []
    reports: dict[str, Any] = {}
    composition, mesh = trainer.strategy.composition, trainer.mesh
    if composition is None:
        return notes, reports
    flat_params = jax.tree.leaves(trainer.state.params)
    step = StepFacts(
        mesh=mesh, jaxpr=trainer.jaxpr, collectives=found, param_paths=paths,
        params=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat_params],
        stored=stored, used=used, batch=[global_struct(x) for x in jax.tree.leaves(batch)],
        batch_shardings=jax.tree.leaves(trainer.batch_shardings), batch_axes=batch_axes,
    )  # fmt: skip
    for part in composition.parts:
        told = part.call("explain_step", axis=part.axis.name, mesh=mesh, step=step)
        if told is None:
            continue
        if not isinstance(told, Explained):
            raise PluginError(
                f"parallelism {part.name!r}: explain_step returned {told!r}, not an "
                f"Explained (or None)"
            )
        notes += list(told.notes)
        if told.name is not None:
            reports[told.name] = told.report
    return notes, reports


def backend_memory(device: Any) -> int | None:
    """The bytes the backend lets this process allocate on ``device`` (None on CPUs, and on
    a device compiled for and not present: a ``--target``'s)."""
    return None if is_compile_only(device) else (device.memory_stats() or {}).get("bytes_limit")


def memory_limit_note(device: Any) -> str:
    """Why a GPU's limit is below its memory, and the setting that changes it."""
    if device.platform != "gpu":
        return f"the peak is above the {device.platform.upper()} backend's limit"
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    given = f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}" if fraction else "75% by default"
    return (
        f"the peak is above what JAX lets this process allocate ({given} of the GPU's "
        "memory): set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 before starting to allow more, or "
        "pass --device-memory to plan for another device"
    )


def _picture(name: str, shape: tuple[int, ...], sharding: NamedSharding) -> dict[str, Any]:
    dims, blocks = regions(shape, sharding)
    return {
        "name": name,
        "shape": list(shape),
        "spec": str(sharding.spec),
        "dims": list(dims),
        "blocks": [[list(r), list(c), ids] for r, c, ids in blocks],
    }


def regions(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[tuple[int, int], list]:
    """The picture of how ``sharding`` splits an array of ``shape``, in two dimensions.

    :return: the two dimensions drawn (the split ones first, else the largest), and for
        each distinct block ``((row0, row1), (col0, col1), device ids)``.
    """
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    split = [d for d in range(len(shape)) if spec[d] is not None]
    rest = sorted(range(len(shape)), key=lambda d: -shape[d])
    dims = sorted([*split, *(d for d in rest if d not in split)][:2])
    while len(dims) < 2:
        dims.append(None)
    blocks: dict[tuple, list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        span = []
        for d in dims:
            if d is None:
                span.append((0, 1))
            else:
                start, stop, _ = index[d].indices(shape[d])
                span.append((start, stop))
        blocks.setdefault(tuple(span), []).append(device.id)
    return tuple(dims), [(r, c, sorted(ids)) for (r, c), ids in sorted(blocks.items())]


__all__ = ["ParamReport", "Report", "explain", "peak_bytes", "regions"]
