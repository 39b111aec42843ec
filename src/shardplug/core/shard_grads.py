"""Each batch shard's gradient, explicitly, under ``jax.jit``: what a step whose plugin
encodes its gradients (``encode_grads``: grad-bf16's bfloat16) computes, so that the sum
across the shards travels in the encoded dtype."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core import means
from shardplug.core.context import per_device_program
from shardplug.core.sharding import lay_out, leading_axes
from shardplug.errors import ConfigError

#: the vmapped axis of the batch's shards, the models' ``batch_axis_name()`` inside
SHARD_AXIS = "shards"


def _batch_split(batch_shardings: Any) -> tuple[tuple[str, ...], Any]:
    """The mesh axes the batch's leading dimension is split over, and which leaves are."""
    found: set[tuple[str, ...]] = set()

    def axes_of(sharding: NamedSharding) -> tuple[str, ...]:
        if any(entry is not None for entry in tuple(sharding.spec)[1:]):
            raise ConfigError(
                "encode_grads needs the batch split along its leading dimension only; "
                f"strategy gave {sharding.spec}"
            )
        axes = leading_axes(sharding.spec)
        if axes:
            found.add(axes)
        return axes

    split = jax.tree.map(lambda s: bool(axes_of(s)), batch_shardings)
    if len(found) > 1:
        raise ConfigError(
            f"encode_grads needs every batch leaf split over the same mesh axes, got {found}"
        )
    return (found.pop() if found else ()), split


def rows_only(batch_shardings: Any) -> bool:
    """Whether the batch is split along its leading dimension alone, over one set of axes
    (what :func:`per_shard_grads` needs)."""
    try:
        axes, _ = _batch_split(batch_shardings)
    except ConfigError:
        return False
    return bool(axes)


def per_shard_grads(grad_fn, strategy, mesh, state, batch, rng, param_shardings, batch_shardings,
                    encodes=True):  # fmt: skip
    """Under ``jax.jit``: each batch shard's gradient, encoded (where ``encodes``: the
    strategy's ``encode_grads``), then summed across shards.

    The batch's leading dimension (split over the axes A) is reshaped to ``(shards, rows)``
    and the step is vmapped over the shards, so each device computes the gradient of its own
    rows, with no communication. The encoded gradients are summed over the shard axis: the
    compiler turns that sum into the all-reduce (or reduce-scatter) over A, in the encoded
    dtype. The vmap's axis is the models' ``batch_axis_name()``, so batch statistics and
    dropout masks stay those of the global batch.
    """
    axes, split = _batch_split(batch_shardings)
    n = math.prod(mesh.shape[a] for a in axes)
    lead = axes if axes else None

    def to_shards(x, is_split):
        if not is_split:
            return x
        x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        spec = P(lead, *([None] * (x.ndim - 1)))
        return lay_out(x, NamedSharding(mesh, spec))

    shards = jax.tree.map(to_shards, batch, split)
    in_axes = jax.tree.map(lambda s: 0 if s else None, split)

    def one_shard(params, model_state, rows):
        (loss, (metrics, state)), grads = grad_fn(params, model_state, rows, rng)
        if means.weighted(metrics):  # the shards' parts are averaged below
            loss, metrics, grads = means.reweigh(loss, metrics, grads, SHARD_AXIS)
        else:
            means.part_means(
                "each batch shard's rows, "
                + ("encode_grads" if encodes else "a gradient summed per shard")
            )
        return (loss, (metrics, state)), strategy.encode_grads(grads, mesh) if encodes else grads

    with per_device_program(SHARD_AXIS):
        (loss, (metrics, model_state)), encoded = jax.vmap(
            one_shard, in_axes=(None, None, in_axes), axis_name=SHARD_AXIS
        )(state.params, state.model_state, shards)

    def stacked(g, sharding):
        # each device keeps its own shard's whole gradient until the reduction
        rest = [_without(entry, axes) for entry in sharding.spec]
        rest += [None] * (g.ndim - 1 - len(rest))
        return lay_out(g, NamedSharding(mesh, P(lead, *rest)))

    def mean_over_shards(g, sharding):
        total = jax.lax.reduce(g, np.zeros((), g.dtype), jax.lax.add, (0,))  # no upcast
        total = total / np.asarray(n, g.dtype)
        return lay_out(total, sharding)

    encoded = jax.tree.map(stacked, encoded, param_shardings)
    grads = jax.tree.map(mean_over_shards, encoded, param_shardings)
    # Batch statistics were averaged over the shards inside; take the mean once more so a
    # model that does not ask for batch_axis_name() gets the shards' average.
    model_state = jax.tree.map(_shard_mean, model_state)
    return jnp.mean(loss), jax.tree.map(jnp.mean, metrics), model_state, grads


def _shard_mean(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


def _without(entry: Any, axes: tuple[str, ...]) -> Any:
    """A partition-spec entry with the batch axes taken out."""
    if entry is None:
        return None
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
