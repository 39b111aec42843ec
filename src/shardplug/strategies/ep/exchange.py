"""ep's exchange: each device's token assignments sent to their experts' devices and back.

Each device holds ``E / n`` of the ``E`` experts (their stacked weights split over the
expert axis) and its own rows of the batch (the expert axis is a batch axis too). Inside a
per-device program over the batch axes, each device sorts its tokens' assignments by the
device that holds their expert, sends them there with one ``all_to_all`` over the expert
axis, computes what it received as one grouped product per matrix (``ragged_dot``, its
experts the groups), and sends the outputs back with a second ``all_to_all``; the backward
pass is the same exchanges transposed.

The buffers are static: a device sends each other device a slot of ``tokens x top_k`` rows
(every assignment could go to one device) when dropless, of ``min(that, E/n x capacity)``
with a capacity factor. XLA:CPU has no ``ragged_all_to_all``, which would send only the
rows used; the bytes sent are the slots'. Capacity is decided as on one device
(:func:`shardplug.plugin.kept_assignments`): when the groups are the batch's devices (or a
multiple), a device counts alone and its slots hold ``E/n x capacity`` rows: ``F x`` the
textbook's bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from shardplug.plugin import (
    ConfigError,
    P,
    capacity_per_group,
    grouped_mlp,
    kept_assignments,
    program_axes,
    queue_places,
)


def exchange(axis: str, batch: tuple[str, ...]) -> Callable:
    """The experts operation of ep: the experts split over ``axis``, the tokens over the
    batch axes ``batch`` (``axis`` among them), exchanged by ``all_to_all``."""

    def routed(x, routing, w_in, w_out, *, w_gate=None, capacity_factor=None,
               capacity_groups=1, activation):  # fmt: skip
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.manual_axes:  # inside another per-device program, where XLA refuses a nested
            # exchange (a pipeline schedule's):
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
        cap = capacity_per_group(tokens, top_k, experts, capacity_factor, groups, devices)
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
        axes, operands = program_axes(
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
    kept = kept_assignments(expert, experts, cap, groups, devices, batch)
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
