"""A routed mixture of experts, as functions every framework's layer calls.

A router scores each token against ``E`` experts; each token goes to its ``top_k`` and comes
back as their outputs weighted by its renormalised router probabilities (Mixtral's rule).
The experts are one stacked parameter per matrix, leading dimension ``E`` (logical axis
``expert``), and compute as one grouped matrix product over the tokens sorted by expert
(``jax.lax.ragged_dot``): not a loop over experts, and not a dense product of every token
with every expert.

- Dropless (the default): every assignment is computed.
- ``capacity_factor=F``: each expert takes at most ``ceil(F * tokens * top_k / E)``
  assignments, the earliest tokens first; the rest are dropped (their weight is zero: the
  token keeps its residual), and :class:`Stats` says what share. ``capacity_groups=G``
  counts capacity in each of G equal groups of consecutive tokens instead (GShard's groups):
  with G the batch's devices, ``ep`` sends each device's assignments in slots of exactly
  ``F x`` their even share, the textbook's bytes at ``F = 1``.

:func:`load_balancing_loss` is Switch Transformer's (and Mixtral's) auxiliary loss,
:func:`router_z_loss` ST-MoE's (:func:`tally` and :func:`summary` compute both from sums a
layer stack carries across layers and microbatches); a ``bias`` added to the scores for
choosing experts only (not to the weights) is auxiliary-loss-free balancing (DeepSeek-V3),
updated outside the gradient by :func:`balance_bias`.

Under ``ep`` (or any parallelism that supplies the experts operation, an
``Operations(experts=...)``) :func:`routed_experts` computes the same across devices: each
device's tokens go to the devices that hold their experts and back. Under any other
composition it is a per-device program over the batch axes (:mod:`.kernels`): each device
routes its own rows through the experts it holds whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core import ops
from shardplug.core.context import batch_axes, microbatched
from shardplug.core.mesh import is_explicit
from shardplug.core.sharding import lay_out
from shardplug.errors import ConfigError
from shardplug.moe import kernels
from shardplug.moe.kernels import capacity


class Routing(NamedTuple):
    """Where each token goes: ``experts`` (tokens, k) int32, ``weights`` (tokens, k) float32
    (they sum to 1 per token), ``probs`` (tokens, E) float32 (the router's softmax)."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array


class Stats(NamedTuple):
    """What one MoE layer did: ``load`` (E,), the share of kept assignments each expert
    computed; ``dropped``, the share of all assignments dropped for capacity; ``kept`` (E,),
    how many assignments each expert computed."""

    load: jax.Array
    dropped: jax.Array
    kept: jax.Array


class Tally(NamedTuple):
    """One MoE layer's routing as sums over its tokens, so that tallies of a batch's parts
    (a pipeline's microbatches) add up to the batch's: ``tokens`` (), ``routed`` (E,) the
    assignments each expert was chosen for, ``kept`` (E,) those it computed, ``probs`` (E,)
    the router's probabilities summed over the tokens, ``z`` () their squared log-sum-exp
    summed. A layer stack returns its blocks' tallies stacked, (layers, ...)."""

    tokens: jax.Array
    routed: jax.Array
    kept: jax.Array
    probs: jax.Array
    z: jax.Array


def tally(logits: jax.Array, routing: Routing, stats: Stats) -> Tally:
    """The :class:`Tally` of one layer: its router's ``logits``, ``routing`` and ``stats``."""
    experts_count = routing.probs.shape[-1]
    routed = _counts(routing.experts, experts_count)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    tokens = jnp.asarray(routing.experts.shape[0], jnp.float32)
    return Tally(tokens, routed, stats.kept, routing.probs.sum(0), jnp.sum(lse**2))


def summary(tallies: Tally) -> dict[str, jax.Array]:
    """The losses and rows of stacked tallies (any leading dimensions, each one layer's),
    averaged over the layers: ``moe_balance_loss`` (:func:`load_balancing_loss`),
    ``moe_z_loss`` (:func:`router_z_loss`), ``expert_load`` (the busiest expert's kept
    assignments over the mean) and ``dropped`` (the share of assignments dropped)."""
    t = tallies
    experts_count = t.routed.shape[-1]
    assignments = t.routed.sum(-1)
    share, mean_prob = t.routed / assignments[..., None], t.probs / t.tokens[..., None]
    per_layer = {
        "moe_balance_loss": experts_count * jnp.sum(share * mean_prob, axis=-1),
        "moe_z_loss": t.z / t.tokens,
        "expert_load": t.kept.max(-1) / jnp.maximum(t.kept.mean(-1), 1e-9),
        "dropped": 1.0 - t.kept.sum(-1) / assignments,
    }
    return {k: v.mean() for k, v in per_layer.items()}


def route(logits: jax.Array, top_k: int, bias: jax.Array | None = None) -> Routing:
    """The ``top_k`` experts of each token (rows of ``logits``, (tokens, E)) and their
    weights: the router's probabilities of the chosen experts, renormalised. ``bias`` (E,)
    shifts the choice, not the weights."""
    experts_count = logits.shape[-1]
    if not 1 <= top_k <= experts_count:
        raise ConfigError(f"top_k={top_k} must be between 1 and the {experts_count} experts")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if bias is not None:
        bias = jax.lax.stop_gradient(bias).reshape((1,) * (probs.ndim - 1) + (-1,))
    scores = probs if bias is None else probs + bias
    _, experts = jax.lax.top_k(scores, top_k)
    chosen = jnp.take_along_axis(probs, experts, axis=-1)
    return Routing(experts.astype(jnp.int32), chosen / chosen.sum(-1, keepdims=True), probs)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """``E * sum_e f_e * P_e``: ``f_e`` the share of assignments to expert ``e``, ``P_e`` its
    mean router probability; 1 when both are uniform, ``E`` when one expert takes all."""
    experts_count = routing.probs.shape[-1]
    counts = _counts(routing.experts, experts_count)
    share = counts / routing.experts.size
    return experts_count * jnp.sum(share * routing.probs.mean(0))


def router_z_loss(logits: jax.Array) -> jax.Array:
    """The mean squared log-sum-exp of the router's logits (keeps them small)."""
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def balance_bias(bias: jax.Array, load: jax.Array, rate: float = 1e-3) -> jax.Array:
    """Auxiliary-loss-free balancing's update: each expert's bias up by ``rate`` if it took
    less than the mean load (over the last dimension: the experts), down if more; for
    stacked layers ``bias`` and ``load`` are (layers, E). No gradient flows through it."""
    load = jax.lax.stop_gradient(load)
    return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)


def routed_experts(
    x: jax.Array,
    routing: Routing,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    w_gate: jax.Array | None = None,
    capacity_factor: float | None = None,
    capacity_groups: int = 1,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
) -> tuple[jax.Array, Stats]:
    """The experts' output for each token of ``x`` (tokens, width).

    ``w_in`` and ``w_gate`` are (E, width, hidden), ``w_out`` (E, hidden, width); with
    ``w_gate`` an expert is ``(activation(x @ w_gate) * (x @ w_in)) @ w_out`` (SwiGLU), without
    it ``activation(x @ w_in) @ w_out``. The assignments are sorted by expert (dropped ones
    last, outside every group, where the grouped product gives zeros) and each matrix is one
    ``ragged_dot``; the outputs are weighted and summed back onto their tokens. With
    ``capacity_factor``, each of ``capacity_groups`` equal runs of consecutive tokens has its
    own capacity. Under a parallelism that places experts (``ep``) the same is computed
    across devices.
    """
    tokens, top_k = routing.experts.shape
    if capacity_groups < 1 or tokens % capacity_groups:
        raise ConfigError(
            f"capacity_groups={capacity_groups} must divide the {tokens} tokens (batch x "
            f"sequence) into equal groups: use a divisor of {tokens}"
        )
    if capacity_factor is not None and microbatched():
        raise ConfigError(
            "a capacity factor under pp would count capacity in each microbatch, not as one "
            "device does: train pp's mixtures of experts dropless (no capacity_factor)"
        )
    override = ops.supplied("experts")  # a parallelism places the experts (ep)
    if override is None and batch_axes():  # each device its own rows
        override = kernels.over_batch(batch_axes())
    placed = None
    if override is not None:
        placed = override(
            x, routing, w_in, w_out, w_gate=w_gate, capacity_factor=capacity_factor,
            capacity_groups=capacity_groups, activation=activation,
        )  # fmt: skip
    if placed is not None:
        y, kept = placed
        return y, _stats(kept, tokens * top_k)
    local = functools.partial(
        _local, w_in=w_in, w_out=w_out, w_gate=w_gate, capacity_factor=capacity_factor,
        capacity_groups=capacity_groups, activation=activation,
    )  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    if is_explicit(mesh) and not mesh.manual_axes:  # sorting by expert needs every row
        rows = jax.typeof(x).sharding.spec
        whole = functools.partial(jax.tree.map, lambda a: lay_out(a, P()))
        y, stats = local(whole(x), whole(routing))
        return lay_out(y, rows), stats
    return local(x, routing)


def _local(x, routing, *, w_in, w_out, w_gate, capacity_factor, capacity_groups, activation):
    """:func:`routed_experts` computed where ``x`` is, every expert at hand."""
    tokens, top_k = routing.experts.shape
    experts_count = w_in.shape[0]
    expert = routing.experts.reshape(-1)  # assignment a = token * k + slot
    kept = jnp.ones(expert.shape, bool)
    if capacity_factor is not None:  # an assignment's place in its expert's queue
        limit = capacity(tokens // capacity_groups, top_k, experts_count, capacity_factor)
        kept = kernels.group_places(expert, experts_count, capacity_groups) < limit
    y, computed = kernels.local_share(
        x, expert, routing.weights.reshape(-1), kept, w_in, w_out, w_gate, activation
    )
    return y, _stats(computed, expert.size)


def _counts(chosen: jax.Array, experts_count: int) -> jax.Array:
    """How many of the assignments ``chosen`` (any shape) went to each expert (float32)."""
    chosen = chosen.reshape(-1)
    mesh = jax.sharding.get_abstract_mesh()
    if is_explicit(mesh) and not mesh.manual_axes:  # a scatter on explicit axes: ids whole
        chosen = lay_out(chosen, P())
    return jnp.zeros(experts_count, jnp.float32).at[chosen].add(1.0)


def _stats(kept: jax.Array, assignments: int) -> Stats:
    load = kept / jnp.maximum(kept.sum(), 1.0)
    return Stats(load, 1.0 - kept.sum() / assignments, kept)


__all__ = [
    "Routing",
    "Stats",
    "Tally",
    "balance_bias",
    "capacity",
    "load_balancing_loss",
    "route",
    "routed_experts",
    "router_z_loss",
    "summary",
    "tally",
]
