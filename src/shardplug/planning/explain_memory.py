"""The bytes a compiled step holds on each device, for :func:`shardplug.planning.explain.explain`.

Parameters, optimizer state, gradients and the batch are counted from their shardings; the
temporaries, arguments and outputs from the compiled program's own memory analysis, less
what offload keeps in host memory, which is counted apart.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardplug.core.memory import (  # fmt: skip
    activations_on_host,
    any_off,
    entry_bytes,
    leafwise,
    off_devices,
    peak_bytes,
)
from shardplug.core.units import size
from shardplug.loop.feed import global_struct


def _bytes(shape: tuple[int, ...], dtype: Any) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # uint32 words per key
        impl = getattr(dtype, "_impl", None)
        return math.prod(shape) * 4 * math.prod(getattr(impl, "key_shape", (2,)))
    return math.prod(shape) * np.dtype(dtype).itemsize


def shard_bytes(x: Any, sharding: NamedSharding) -> int:
    """The bytes of the shard of ``x`` that one device holds under ``sharding``."""
    return _bytes(sharding.shard_shape(tuple(x.shape)), x.dtype)


def tree_bytes(tree: Any, shardings: Any) -> int:
    """The bytes of ``tree`` that one device holds under ``shardings`` (a tree like it)."""
    leaves = jax.tree.leaves(tree)
    return sum(shard_bytes(x, s) for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True))


def _on_device(analysis: Any, name: str, host: int) -> int | None:
    """A compiled program's ``name`` (argument, output) bytes in the device's own memory:
    less those laid out in host memory where the backend counts them among the device's
    (XLA:CPU; a backend that reports host arguments apart has left them out)."""
    size = getattr(analysis, f"{name}_size_in_bytes", None)
    if size is None or getattr(analysis, f"host_{name}_size_in_bytes", 0):
        return size
    return size - host


def per_device_bytes(
    trainer: Any,
    batch: Any,
    trains: list[bool],
    analysis: Any,
    hlo_text: str,
    device_memory: int | None,
) -> dict[str, int | None]:
    """The report's ``per_device``: what each device holds of the state, the gradients and
    the batch, and the compiled program's figures (``trains``: whether each parameter is
    trained; a frozen one has no gradient)."""
    state, shardings = trainer.state, trainer.state_shardings
    flat_shardings = jax.tree.leaves(shardings.params)
    trained = [p for p, t in zip(jax.tree.leaves(state.params), trains, strict=True) if t]
    trained_shardings = [s for s, t in zip(flat_shardings, trains, strict=True) if t]
    entry = entry_bytes(hlo_text)
    return {
        "params_bytes": tree_bytes(state.params, shardings.params),
        "opt_state_bytes": tree_bytes(state.opt_state, shardings.opt_state),
        # the reduced gradient, as the strategy leaves it: laid out like the parameters (the
        # trained ones: a frozen parameter has none)
        "grads_bytes": tree_bytes(trained, trained_shardings),
        "model_state_bytes": tree_bytes(state.model_state, shardings.model_state),
        "batch_bytes": tree_bytes(jax.tree.map(global_struct, batch), trainer.batch_shardings),
        "temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
        # in the device's own memory: what offload keeps on the host is counted apart
        "argument_bytes": _on_device(analysis, "argument", entry["arguments"]["host"]),
        "output_bytes": _on_device(analysis, "output", entry["outputs"]["host"]),
        "alias_bytes": getattr(analysis, "alias_size_in_bytes", 0) or 0,
        # in host memory, each device's share (offload): not in the device's peak
        "host_bytes": entry["arguments"]["host"],
        "peak_bytes": peak_bytes(analysis, hlo_text),
        "device_memory_bytes": device_memory,
    }


def brought_for_update(trainer: Any, shardings: Any, state: Any, mesh: Any) -> int:
    """The most bytes per device of the optimizer state that the step holds on the devices
    at once for the update, copied from host memory: one parameter's where it brings the
    state a parameter at a time (:func:`shardplug.core.memory.leafwise`), else all of it;
    0 where it stays on the devices, or the update runs on the host."""
    if not any_off(shardings.opt_state):
        return 0
    if trainer.strategy.update_memory(shardings, mesh) == "host":
        return 0
    leaves = jax.tree.leaves(state.opt_state)
    sizes = [
        tree_bytes(x, s) if off_devices(s) else 0  # the devices' own are counted
        for x, s in zip(leaves, jax.tree.leaves(shardings.opt_state), strict=True)
    ]
    labels = leafwise(trainer.optimizer, state.params, state.opt_state, state.params)
    if labels is None:
        return sum(sizes)
    pieces: dict[int, int] = {}
    for label, n in zip(labels, sizes, strict=True):
        pieces[label] = pieces.get(label, 0) + n
    shared = pieces.pop(-1, 0)
    return shared + max(pieces.values(), default=0)


def host_memory_notes(trainer: Any, platform: str, brought: int) -> list[str]:
    """Where XLA:CPU's one memory makes the figures above differ from a GPU's: the optimizer
    state copied in from the host for the update (``brought`` bytes per device at most), and
    the activations the step moves to the host between the passes."""
    notes = []
    if brought and platform == "cpu":
        notes.append(
            f"the optimizer state kept in host memory is copied to the devices for the update, "
            f"at most {size(brought)} per device at once: XLA:CPU keeps one memory and counts "
            f"no copy, so the peak above leaves it out; on a GPU the update holds it beside "
            f"the parameters and gradients (offload's update=host leaves it on the host)"
        )
    if platform == "cpu" and activations_on_host(trainer.jaxpr):
        notes.append(
            "the step moves activations it saves for the backward pass to host memory "
            "(--remat offload): XLA:CPU keeps one memory, so the temporaries above count "
            "them; on a GPU the devices keep none of them between the passes"
        )
    return notes
