"""The kernels of a mixture of experts: the grouped product, queue places and capacity, and
the layer as a per-device program over the batch's rows.

The experts are one stacked parameter per matrix (leading dimension ``E``) and compute as
one grouped matrix product over the assignments sorted by expert (``jax.lax.ragged_dot``):
:func:`grouped_mlp`. Capacity is decided as on one device: an assignment's place in its
expert's queue (:func:`queue_places`) against ``ceil(F x tokens x top_k / E)``
(:func:`capacity`), counted in groups of consecutive tokens; where several devices share a
group, each counts the earlier devices' assignments in it (:func:`kept_assignments`).

Where no parallelism supplies the experts operation, :func:`over_batch` makes the layer a
per-device program over the batch axes: each device sorts only its own rows' assignments
and runs them through the experts it holds whole (a sort of the whole batch's assignments
would cross devices). ``ep`` supplies an exchange built from these kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core.mesh import is_explicit
from shardplug.core.operations import beside
from shardplug.core.sharding import lay_out
from shardplug.errors import ConfigError


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
    # group E (the dropped) falls off the end; no slice of a split array (a collective-permute)
    sizes = jnp.zeros(experts, jnp.int32).at[group].add(1, mode="drop")
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


def capacity_per_group(tokens, top_k, experts, factor, groups, devices) -> int | None:
    """The capacity of each expert in each of ``groups`` groups of the ``tokens`` split over
    ``devices``; None when dropless (``factor`` None). Groups and devices must nest."""
    if factor is None:
        return None
    if groups % devices and devices % groups:
        raise ConfigError(
            f"capacity_groups={groups} and the batch's {devices} devices: one must divide "
            f"the other (a capacity group on whole devices, or devices on whole groups)"
        )
    return capacity(tokens // groups, top_k, experts, factor)


def kept_assignments(expert, experts, cap, groups, devices, batch):
    """Which of this device's assignments (``expert``: their experts, in order) its
    experts' capacity ``cap`` keeps, as on one device: inside a per-device program over the
    batch axes ``batch`` (``devices`` of them), in ``groups`` capacity groups."""
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


def program_axes(batch: tuple[str, ...], specs: list[P], operands: list) -> tuple[set, list]:
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


def over_batch(batch: tuple[str, ...]) -> Callable:
    """The experts operation of a layer computed per device over the batch axes ``batch``:
    each device routes its own rows through the experts it holds whole."""

    def routed(x, routing, w_in, w_out, *, w_gate=None, capacity_factor=None,
               capacity_groups=1, activation):  # fmt: skip
        mesh = jax.sharding.get_abstract_mesh()
        devices = math.prod(mesh.shape[a] for a in batch) if batch else 1
        if mesh.manual_axes or devices == 1:  # already per device (pmap, pp), or one device
            return None
        tokens, top_k = routing.experts.shape
        experts = w_in.shape[0]
        cap = capacity_per_group(tokens, top_k, experts, capacity_factor, capacity_groups, devices)
        rows, whole = P(batch, None), P()
        weights = [w for w in (w_in, w_out, w_gate) if w is not None]
        gated = w_gate is not None

        def program(x, experts_of, weights_of, w_in, w_out, *gate):
            expert = experts_of.reshape(-1)
            kept = kept_assignments(expert, experts, cap, capacity_groups, devices, batch)
            y, computed = local_share(x, expert, weights_of.reshape(-1), kept, w_in, w_out,
                                      gate[0] if gated else None, activation)  # fmt: skip
            return y, jax.lax.psum(computed, batch)

        specs = [rows, rows, rows, *([whole] * len(weights))]
        axes, operands = program_axes(batch, specs, [x, routing.experts, routing.weights, *weights])
        return jax.shard_map(
            program, in_specs=tuple(specs), out_specs=(rows, P()), axis_names=axes
        )(*operands)

    return routed


def _beside(eqn, ins, at):
    """A grouped product by a made weight (LoRA's, :mod:`shardplug.core.operations.beside`): ``x W``
    plus ``(x L) R``, each a grouped product over the same groups; None (merged) where the
    weight is not the stored ``(experts, in, out)``."""
    x, w, groups = ins
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (contract, batch) = numbers.dot_dimension_numbers
    stored = (tuple(contract[0]), tuple(contract[1])) == ((x.ndim - 1,), (1,)) and not any(
        batch) and tuple(numbers.rhs_group_dimensions) == (0,)  # fmt: skip
    if at != 1 or not isinstance(w, beside.Made) or not w.plain() or not stored:
        return None
    dtype = w.base.dtype
    product = beside.bind(eqn, [x, w.base, groups])[0]
    low = beside.bind(eqn, [w.dropped(x), w.left.astype(dtype), groups])[0]
    return w.joined(product, beside.bind(eqn, [low.astype(dtype), w.right.astype(dtype),
                                               groups])[0])  # fmt: skip


beside.PRODUCTS["ragged_dot_general"] = _beside
