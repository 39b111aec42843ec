"""Batch statistics and dropout that give the same numbers on any number of devices.

Under ``jax.jit`` they are the plain operations. Inside an explicit per-device program
(:func:`shardplug.batch_axis_name` is set) they reproduce what the global batch would give:
moments averaged over the batch axis, and each device's rows of the one global dropout mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from shardplug.core.context import batch_axis_name


def batch_moments(x: jax.Array, axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Mean and (biased) variance of ``x`` over ``axes`` of the global batch."""
    mean = jnp.mean(x, axis=tuple(axes))
    mean_sq = jnp.mean(jnp.square(x), axis=tuple(axes))
    axis = batch_axis_name()
    if axis is not None:
        mean, mean_sq = jax.lax.pmean((mean, mean_sq), axis)
    return mean, jnp.maximum(mean_sq - jnp.square(mean), 0.0)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Zero each element with probability ``rate`` (scaling the rest), rows along axis 0.

    The mask is that of the global batch whatever the device count: a per-device program
    draws the global mask from the same key and keeps its own rows.
    """
    if rate == 0.0:
        return x
    axis = batch_axis_name()
    if axis is None:
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    else:
        rows = x.shape[0]
        full = jax.random.bernoulli(key, 1.0 - rate, (rows * jax.lax.axis_size(axis), *x.shape[1:]))
        keep = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis) * rows, rows)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
