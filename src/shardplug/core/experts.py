"""Experts placed over devices: what ``ep`` puts in place of a mixture of experts' local
computation (:func:`shardplug.moe.routed_experts`) while the step is traced.

Each device holds ``E / n`` of the ``E`` experts (their stacked weights split over the
expert axis) and its own rows of the batch (the expert axis is a batch axis too). Inside a
per-device program over the batch axes, each device sorts its tokens' assignments by the
device that holds their expert, sends them there with one ``all_to_all`` over the expert
axis, computes what it received as one grouped product per matrix (``ragged_dot``, its
experts the groups), and sends the outputs back with a second ``all_to_all``; the backward
pass is the same exchanges transposed.

Where no parallelism places experts, the trainer still makes the layer a per-device program
over the batch axes (:func:`over_batch`): each device sorts only its own rows' assignments
and runs them through the experts it holds whole.

The buffers are static: a device sends each other device a slot of ``tokens x top_k`` rows
(every assignment could go to one device) when dropless, of ``min(that, E/n x capacity)``
with a capacity factor. XLA:CPU has no ``ragged_all_to_all``, which would send only the
rows used; the bytes sent are the slots'. Capacity is decided as on one device: an
assignment's place in its expert's queue counts the assignments of every device before it
in its capacity group (an ``all_gather`` of each device's counts), so dropping is
identical. When the groups are the batch's devices (or a multiple), a device counts alone
and its slots hold ``E/n x capacity`` rows: ``F x`` the textbook's bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core.mesh import is_explicit
from shardplug.core.sharding import lay_out
from shardplug.errors import ConfigError

_OVERRIDE: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "shardplug_experts", default=None
)


@contextlib.contextmanager
def experts_override(implementation: Callable[..., Any]) -> Iterator[None]:
    """Inside, :func:`shardplug.moe.routed_experts` calls ``implementation`` with its own
    arguments instead of computing locally (a parallelism placing experts installs it from
    its ``trace_context``); it returns the output and each expert's kept assignments (E,),
    or None to have them computed as on one device."""
    token = _OVERRIDE.set(implementation)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def active() -> Callable[..., Any] | None:
    """The installed experts implementation, or None."""
    return _OVERRIDE.get()


def queue_places(expert: jax.Array, experts: int) -> jax.Array:
    """Each assignment's place (0-based) among the assignments to its expert, in order."""
    mine = expert[:, None] == jnp.arange(experts)[None, :]
    return jnp.sum(jnp.cumsum(mine, axis=0) * mine, axis=1) - 1


def group_places(expert: jax.Array, experts: int, groups: int) -> jax.Array:
    """:func:`queue_places` in each of ``groups`` equal runs of the assignments apart."""
    places = jax.vmap(queue_places, (0, None))(expert.reshape(groups, -1), experts)
    return places.reshape(-1)


def grouped_mlp(
    rows: jax.Array,
    group: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    w_gate: jax.Array | None,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Each row through its group's expert (``group`` in ``[0, E]``, ``E``: none, zeros out),
    as one ``ragged_dot`` per matrix over the rows sorted by group."""
    mesh = jax.sharding.get_abstract_mesh()
    if is_explicit(mesh):  # JAX infers no layout for ragged_dot's transpose: a per-device
        free = _free_axes(mesh)  # program
        operands = [lay_out(a, P()) for a in (rows, group, w_in, w_out, w_gate) if a is not None]
        gated = w_gate is not None

        def program(rows, group, w_in, w_out, *gate):
            return grouped_mlp(rows, group, w_in, w_out, gate[0] if gated else None, activation)

        return jax.shard_map(program, in_specs=P(), out_specs=P(), axis_names=free)(*operands)
    dot, experts = jax.lax.ragged_dot, w_in.shape[0]
    order = jnp.argsort(group, stable=True)
    sizes = jnp.zeros(experts + 1, jnp.int32).at[group].add(1)[:experts]
    sorted_rows = rows[order]
    hidden = dot(sorted_rows, w_in, sizes)
    if w_gate is not None:
        hidden = activation(dot(sorted_rows, w_gate, sizes)) * hidden
    else:
        hidden = activation(hidden)
    out = dot(hidden.astype(w_out.dtype), w_out, sizes)
    return jnp.zeros_like(out).at[order].set(out)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """How many assignments an expert takes at ``factor``: ``ceil(factor * tokens * k / E)``."""
    return max(1, math.ceil(factor * tokens * top_k / experts))


@contextlib.contextmanager
def expert_parallel(
    axis: str, batch_axes: tuple[str, ...], unrouted: Callable[[], None] | None = None
) -> Iterator[None]:
    """Trace the code inside with the experts split over ``axis`` and the tokens over
    ``batch_axes`` (``axis`` among them), exchanged by ``all_to_all`` (see the module);
    ``unrouted()`` is called after a program that never routed through
    :func:`shardplug.moe.routed_experts` (its experts, if any, were computed by the compiler
    wherever it put them)."""
    called = []
    placed = _placed(axis, tuple(batch_axes))

    def counted(*args, **kwargs):
        called.append(True)
        return placed(*args, **kwargs)

    with experts_override(counted):
        yield
    if not called and unrouted is not None:
        unrouted()


def over_batch(batch_axes: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """Trace the code inside with each device routing its own rows of the batch (split over
    ``batch_axes``) through every expert it holds whole: a per-device program, so sorting the
    assignments by expert never crosses devices (the trainer's default where no parallelism
    places experts; one all-gather of counts when capacity spans devices)."""
    return experts_override(_over_batch(tuple(batch_axes)))


def local_share(x, expert, weight, kept, w_in, w_out, w_gate, activation):
    """The experts' output for the rows ``x`` whose assignments (``expert``, ``weight``, one
    per token x top_k, in order) are ``kept``, every expert at hand; and each expert's count of
    kept assignments (E,) float32."""
    experts = w_in.shape[0]
    token = jnp.arange(expert.size) // (expert.size // x.shape[0])
    group = jnp.where(kept, expert, experts)  # the dropped: past the last group
    out = grouped_mlp(x[token], group, w_in, w_out, w_gate, activation)
    weight = jnp.where(kept, weight, 0.0)
    y = jnp.zeros_like(x).at[token].add((out * weight[:, None]).astype(x.dtype))
    return y, jnp.zeros(experts, jnp.float32).at[expert].add(kept.astype(jnp.float32))


def _plan(tokens, top_k, experts, factor, groups, devices) -> int | None:
    """The capacity of each expert in each group, None when dropless."""
    if factor is None:
        return None
    if groups % devices and devices % groups:
        raise ConfigError(
            f"capacity_groups={groups} and the batch's {devices} devices: one must divide "
            f"the other (a capacity group on whole devices, or devices on whole groups)"
        )
    return capacity(tokens // groups, top_k, experts, factor)


def _kept(expert, experts, cap, groups, devices, batch):
    """Which of this device's assignments its experts' capacity keeps, as on one device."""
    if cap is None:
        return jnp.ones(expert.shape, bool)
    if groups % devices == 0:  # my groups are mine alone
        return group_places(expert, experts, groups // devices) < cap
    # my place in each queue: after the assignments of earlier devices in my group
    counts = jnp.zeros(experts, jnp.int32).at[expert].add(1)
    every = jax.lax.all_gather(counts, batch)  # (devices, experts), in the batch's order
    me, shared = jax.lax.axis_index(batch), devices // groups
    others = jnp.arange(devices)
    earlier = (others < me) & (others // shared == me // shared)
    before = jnp.sum(every * earlier[:, None], axis=0)
    return queue_places(expert, experts) + before[expert] < cap


def _program(batch: tuple[str, ...], specs: list[P], operands: list) -> tuple[set, list]:
    """The axes a per-device program over ``batch`` is manual over, and its operands laid out
    as ``specs`` say. On auto axes: the batch's (the compiler keeps the others' layouts). On
    explicit axes: every free axis, the operands laid out exactly (whole over the axes their
    spec does not name), since XLA refuses a program nested in one (the grouped product's
    would be, on tensor parallelism's axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not is_explicit(mesh):
        return set(batch), operands
    return _free_axes(mesh), [lay_out(a, s) for a, s in zip(operands, specs, strict=True)]


def _free_axes(mesh) -> set[str]:
    """The mesh's explicit axes no enclosing per-device program is manual over."""
    kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
    return {a for a, t in kinds if t == jax.sharding.AxisType.Explicit}


def _over_batch(batch: tuple[str, ...]) -> Callable:
    def routed(x, routing, w_in, w_out, *, w_gate=None, capacity_factor=None,
               capacity_groups=1, activation):  # fmt: skip
        mesh = jax.sharding.get_abstract_mesh()
        devices = math.prod(mesh.shape[a] for a in batch) if batch else 1
        if mesh.manual_axes or devices == 1:  # already per device (pmap, pp), or one device
            return None
        tokens, top_k = routing.experts.shape
        experts = w_in.shape[0]
        cap = _plan(tokens, top_k, experts, capacity_factor, capacity_groups, devices)
        rows, whole = P(batch, None), P()
        weights = [w for w in (w_in, w_out, w_gate) if w is not None]
        gated = w_gate is not None

        def program(x, experts_of, weights_of, w_in, w_out, *gate):
            expert = experts_of.reshape(-1)
            kept = _kept(expert, experts, cap, capacity_groups, devices, batch)
            y, computed = local_share(x, expert, weights_of.reshape(-1), kept, w_in, w_out,
                                      gate[0] if gated else None, activation)  # fmt: skip
            return y, jax.lax.psum(computed, batch)

        specs = [rows, rows, rows, *([whole] * len(weights))]
        axes, operands = _program(batch, specs, [x, routing.experts, routing.weights, *weights])
        return jax.shard_map(
            program, in_specs=tuple(specs), out_specs=(rows, P()), axis_names=axes
        )(*operands)

    return routed


def _placed(axis: str, batch: tuple[str, ...]) -> Callable:
    def routed(x, routing, w_in, w_out, *, w_gate=None, capacity_factor=None,
               capacity_groups=1, activation):  # fmt: skip
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.manual_axes:  # inside pp's schedule, where XLA refuses a nested exchange:
            return None  # computed as on one device, each layer's experts gathered
        size, experts = mesh.shape[axis], w_in.shape[0]
        if experts % size:
            raise ConfigError(
                f"{experts} experts do not split over the {size} devices of {axis!r}: use a "
                f"number of experts that {size} divides, or fewer expert devices (--mesh)"
            )
        tokens, top_k = routing.experts.shape
        devices = math.prod(mesh.shape[a] for a in batch)
        local = tokens // devices * top_k  # one device's assignments
        groups = capacity_groups
        cap = _plan(tokens, top_k, experts, capacity_factor, groups, devices)
        mine = max(1, groups // devices)  # groups a device holds (or 1 group, shared)
        slot = local if cap is None else min(local, experts // size * cap * mine)
        rows = P(batch, None)
        weights = P(axis, None, None)
        program = functools.partial(
            _exchange, axis=axis, batch=batch, size=size, slot=slot, cap=cap,
            activation=activation, gated=w_gate is not None, groups=groups, devices=devices,
        )  # fmt: skip
        gates = () if w_gate is None else (w_gate,)
        specs = [rows, rows, rows, weights, weights, *((weights,) if gates else ())]
        axes, operands = _program(
            batch, specs, [x, routing.experts, routing.weights, w_in, w_out, *gates]
        )
        return jax.shard_map(
            program, in_specs=tuple(specs), out_specs=(rows, P()), axis_names=axes
        )(*operands)

    return routed


def _exchange(x, experts_of, weights_of, w_in, w_out, *gate, axis, batch, size, slot, cap,
              activation, gated, groups, devices):  # fmt: skip
    """One device's share: its assignments to their experts' devices and back."""
    per_device = w_in.shape[0]
    experts = per_device * size
    expert = experts_of.reshape(-1)
    token = jnp.arange(expert.size) // experts_of.shape[1]
    kept = _kept(expert, experts, cap, groups, devices, batch)
    dest = expert // per_device
    place = queue_places(jnp.where(kept, dest, size), size)  # in its destination's slot
    ok = kept & (place < slot)
    where = jnp.where(ok, dest, size)  # out of range: not sent (mode="drop")
    send = jnp.zeros((size, slot, x.shape[-1]), x.dtype).at[where, place].set(x[token], mode="drop")
    ids = (
        jnp.full((size, slot), per_device, jnp.int32)
        .at[where, place]
        .set(expert % per_device, mode="drop")
    )
    got = jax.lax.all_to_all(send, axis, 0, 0)  # got[j]: what device j sent me
    got_ids = jax.lax.all_to_all(ids, axis, 0, 0)
    out = grouped_mlp(
        got.reshape(-1, x.shape[-1]), got_ids.reshape(-1), w_in, w_out,
        gate[0] if gated else None, activation,
    ).reshape(got.shape)  # fmt: skip
    back = jax.lax.all_to_all(out, axis, 0, 0)  # back[j]: my rows, computed on device j
    mine = back[jnp.where(ok, dest, 0), jnp.where(ok, place, 0)]
    weight = jnp.where(ok, weights_of.reshape(-1), 0.0)
    y = jnp.zeros_like(x).at[token].add((mine * weight[:, None]).astype(x.dtype))
    computed = jnp.zeros(experts, jnp.float32).at[expert].add(ok.astype(jnp.float32))
    return y, jax.lax.psum(computed, batch)  # each expert's kept assignments
