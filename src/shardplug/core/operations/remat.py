"""Rematerialisation by name: what a block keeps for the backward pass, and where.

``offload`` is ``full`` with each block's input (the one activation ``full`` keeps per layer)
moved to pinned host memory in the forward pass and brought back for the backward: the
device keeps no activation between the two passes. The input carries the name
:data:`LAYER_INPUT` (:func:`named_input`) so JAX's offloading policy can find it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from shardplug.errors import ConfigError

REMAT_POLICIES = ("none", "dots", "full", "offload")

#: the name a block's input carries under ``offload``
LAYER_INPUT = "shardplug_layer_input"

#: the memory a block's input is moved to under ``offload``
HOST = "pinned_host"


def saveable(policy: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy of a remat name; None for ``none`` (no checkpoint)."""
    if policy not in REMAT_POLICIES:
        raise ConfigError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {policy!r}")
    if policy == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device", offload_dst=HOST,
        )  # fmt: skip
    return {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[policy]


def named_input(fn: Callable, policy: str) -> Callable:
    """``fn(layer, h, *rest)`` with ``h``'s arrays named :data:`LAYER_INPUT` under
    ``offload`` (so its policy moves them to the host); ``fn`` itself under any other."""
    if policy != "offload":
        return fn

    def run(layer: Any, h: Any, *rest: Any) -> Any:
        return fn(layer, jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), h), *rest)

    return run


def remat(fn: Callable, policy: str) -> Callable:
    """``fn`` with its activations kept (``none``), all recomputed in the backward pass
    (``full``), all but the outputs of matrix products without batch dimensions
    (the weight products) recomputed (``dots``), or all recomputed from its input kept in
    host memory (``offload``)."""
    keep = saveable(policy)
    return fn if keep is None else jax.checkpoint(named_input(fn, policy), policy=keep)
