"""What runs in and around a pipeline's manual region, tick by tick: buffers of slots read
and written in place, sends round the stage ring, values leaving the region, and an order of
collectives kept by data (XLA:CPU runs what does not wait on each other in any order, and
each device its own).

A buffer is ``(slots, 1, 1, *one value)`` inside the region (stages and replicas split
away): read and written by its first index, never reshaped, since a buffer given another
layout is copied whole on every tick.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.plugin import is_explicit, mesh_axes
from shardplug.strategies.pp.stages import sums_in_float32


def after(value: Any, *before: Any) -> Any:
    """``value``, once ``before`` (and ``value``) are computed: an order of collectives that
    every device keeps (``lax.optimization_barrier``)."""
    return (
        jax.lax.optimization_barrier((value, before))[0]
        if before
        else (jax.lax.optimization_barrier(value))
    )


def sent(any_send: Any, value: Any, axis: str, perm: list[tuple[int, int]]) -> Any:
    """``value`` sent round the ring where some stage sends this tick (else zeros), as a
    buffer of one slot."""
    return jax.lax.cond(
        any_send > 0,
        lambda: jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm)[None, None, None], value),
        lambda: jax.tree.map(lambda a: jnp.zeros_like(a)[None, None, None], value),
    )


def leaving(flag: Any, value: Any, mine: Any, axis: str, replicas: tuple[str, ...]) -> Any:
    """One stage's ``value`` for outside the region (the sum over the stage axis, the rest
    zeros), where ``flag`` says it leaves this tick; the aux of a message ``(h, aux)`` also
    summed over the replicas' rows."""

    def out():
        summed = jax.tree.map(lambda a: psum_cpu_safe(jnp.where(mine, a, 0), axis), value)
        if replicas and isinstance(summed, tuple):
            return summed[0], jax.tree.map(lambda a: psum_cpu_safe(a, replicas), summed[1])
        return summed

    return jax.lax.cond(flag, out, lambda: zeros(value))


def psum_cpu_safe(x: jax.Array, axes: Any) -> jax.Array:
    """``psum``, of a 16-bit float in float32 on CPU (where XLA's compiler aborts on it)."""
    if sums_in_float32(x.dtype):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def zeros(tree: Any) -> Any:
    """Zeros like each leaf of ``tree`` (arrays or their shapes), laid out alike on explicit
    axes (where ``lax.cond``'s branches must agree)."""

    def one(a):
        if isinstance(a, jax.Array):
            return jnp.zeros_like(a)
        z = jnp.zeros(a.shape, a.dtype)
        spec = getattr(getattr(a, "sharding", None), "spec", None)
        if spec is None or not is_explicit(jax.sharding.get_abstract_mesh()):
            return z
        return jax.sharding.reshard(z, spec) if any(e is not None for e in spec) else z

    return jax.tree.map(one, tree)


def read_slot(buf: Any, slot: Any) -> Any:
    """Slot ``slot`` (clamped to 0) of each ``(slots, 1, 1, ...)`` buffer of ``buf``."""
    at = jnp.maximum(slot, 0)
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, at, 0, False)[0, 0], buf)


def write_slot(buf: Any, slot: Any, value: Any) -> Any:
    """``value`` written into slot ``slot`` of each buffer, in place."""
    return jax.tree.map(
        lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype)[None, None], slot, 0),
        buf, value,
    )  # fmt: skip


def write_if_slot(buf: Any, slot: Any, value: Any) -> Any:
    """``value`` into slot ``slot`` where ``slot`` >= 0 (else the buffer as it was)."""
    at = jnp.maximum(slot, 0)
    kept = jax.tree.map(lambda b, x: jnp.where(slot >= 0, x.astype(b.dtype), b), read_slot(buf, at),
                        value)  # fmt: skip
    return write_slot(buf, at, kept)


def matched(tree: Any, specs: Any, manual: set[str]) -> Any:
    """On explicit axes, ``tree`` laid out over the ``manual`` axes as ``specs`` say (the
    other axes as they are), as ``jax.shard_map`` requires of its operands; else as it is."""
    if not is_explicit(jax.sharding.get_abstract_mesh()):
        return tree

    def one(x, spec):
        now = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
        want = tuple(spec) + (None,) * x.ndim
        out = []
        for d in range(x.ndim):
            kept = tuple(a for a in mesh_axes(P(now[d])) if a not in manual)
            axes = tuple(mesh_axes(P(want[d]))) + kept
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        target = P(*out)
        return x if tuple(now[: x.ndim]) == tuple(out) else jax.sharding.reshard(x, target)

    return jax.tree.map(one, tree, specs, is_leaf=lambda s: isinstance(s, P))
