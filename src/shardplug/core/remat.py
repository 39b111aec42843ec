"""Rematerialisation by name: what a block keeps for the backward pass."""

from __future__ import annotations

from collections.abc import Callable

import jax

from shardplug.errors import ConfigError

REMAT_POLICIES = ("none", "dots", "full")


def saveable(policy: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy of a remat name; None for ``none`` (no checkpoint)."""
    if policy not in REMAT_POLICIES:
        raise ConfigError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {policy!r}")
    return {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[policy]


def remat(fn: Callable, policy: str) -> Callable:
    """``fn`` with its activations kept (``none``), all recomputed in the backward pass
    (``full``), or all but the outputs of matrix products without batch dimensions
    (the weight products) recomputed (``dots``)."""
    keep = saveable(policy)
    return fn if keep is None else jax.checkpoint(fn, policy=keep)
