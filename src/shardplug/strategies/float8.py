"""The ``float8`` add-on: the model's linear layers multiply in float8, forward and backward.

It follows torchtitan's float8 training (and MaxText's ``fp8_full`` through Qwix): dynamic
scaling, computed from each tensor in the step that uses it (no amax history to keep,
checkpoint or resume), the forward product in ``float8_e4m3fn`` and the gradients' in
``float8_e5m2``, per tensor (``scaling=tensor``, the default: the fastest) or per row
(``scaling=row``: an outlier costs its own row's precision alone). Transformer Engine's
delayed scaling (a history of amaxes carried in the state) was left aside: it changes what
a checkpoint holds, and torchtitan measured dynamic tensorwise scaling as fast at 8B.

It is an add-on (``--addon float8``): it owns no mesh axis and changes no layout, so it goes
with every strategy and composition. Through the ``held_weights`` hook it names the weights
whose products run in float8 (``targets``, a pattern searched in each parameter's path; by
default the weight of every linear layer, read from the traced step: not the head, whose
product's output reaches the loss as logits, nor embeddings (gathered), routers, a
mixture's experts, convolutions' kernels, norms or biases), and core's rewrite of the step's
forward pass runs each ``dot_general`` by them as
:func:`shardplug.finetuning.float8.float8_dot_general`, in NNX, Linen and Equinox alike, a layer
stack's a layer at a time inside its loop (under ``--remat`` and pp's schedules too).
Attention's own products (scores, values) are not a weight's, and stay as they are. The
master weights, gradients and optimizer state stay as they were; evaluation multiplies as
before; checkpoints do not change. On explicit mesh axes, where each product would have to
name its output's layout, it steps aside (said once).

Off a GPU with float8 tensor cores (Hopper, Ada and later) the products are emulated:
right, and slower than bfloat16's, said once.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from shardplug.finetuning.float8 import FLOAT8_DEVICES, SCALINGS, float8_dot_general
from shardplug.finetuning.lora import NOT_TARGETS
from shardplug.plugin import (
    HELD_RULES,
    ConfigError,
    Hold,
    StrategyOptionError,
    hookimpl,
    is_explicit,
    leaf_paths,
    warn_once,
)

#: what no pattern makes a target: biases, scales and norms (a stack's are matrices)
_NEVER = re.compile(r"(^|/)(bias|scale|b|g)$|norm", re.IGNORECASE)
#: what the default targets leave out besides: LoRA's exclusions, in any case, a mixture's
#: experts (their grouped product has no float8 rule yet) and convolutions' kernels
_NOT_TARGETS = re.compile(f"{NOT_TARGETS.pattern}|expert|conv", re.IGNORECASE)



class Float8:
    """The linear layers' matrix products in float8: e4m3 forward, e5m2 gradients, scaled
    per tensor or per row (``scaling``); ``targets``: a pattern searched in each parameter's
    path (default: every linear layer's weight, read from the traced step)."""

    description = "the linear layers' matrix products in float8 (e4m3 forward, e5m2 backward)"

    def __init__(self, targets: str = "", scaling: str = "tensor"):
        if scaling not in SCALINGS:
            raise StrategyOptionError(
                f"float8 option scaling must be {' or '.join(SCALINGS)}, got {scaling!r}"
            )
        try:
            self.pattern = re.compile(targets) if targets else None
        except re.error as exc:
            raise StrategyOptionError(f"float8 option targets {targets!r}: {exc}") from None
        self.scaling = scaling

    def targets(self, params: Any, roles: Any = None) -> list[str | None]:
        """Each leaf's path where its products run in float8, None elsewhere: by default
        the weight of every linear layer, as ``roles`` (:class:`shardplug.plugin.Role` by
        path, read from the traced step) says: not the head, embeddings, routers, a
        mixture's experts, convolutions, norms or biases. Without ``roles`` (a model that
        traces only inside a strategy's program), by name: every matrix (a layer stack's
        too) but LoRA's exclusions and biases and scales (a stack's are matrices)."""
        out = []
        for path, leaf in zip(leaf_paths(params), jax.tree.leaves(params), strict=True):
            matrix = jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2
            if self.pattern is not None:
                chosen = self.pattern.search(path) is not None and not _NEVER.search(path)
            elif roles is not None and path in roles:
                chosen = roles[path].kind == "linear"
            else:
                chosen = _NOT_TARGETS.search(path) is None and not _NEVER.search(path)
            out.append(path if matrix and chosen else None)
        if not any(out):
            said = (f"targets {self.pattern.pattern!r}" if self.pattern is not None
                    else "the default targets")  # fmt: skip
            raise ConfigError(
                f"float8: {said} match no matrix of this model; its parameters are "
                f"{', '.join(leaf_paths(params)[:6])}: give -o float8.targets=REGEX"
            )
        return out

    @hookimpl
    def held_weights(self, params, mesh, roles):
        if is_explicit(mesh):
            warn_once(
                "float8 on explicit mesh axes is not built yet (each of its products would "
                "have to name its output's layout): the products run as they were; train on "
                "auto axes (--axis-types auto) for float8"
            )
            return None
        kinds = {d.device_kind for d in mesh.devices.flat}
        if not all(FLOAT8_DEVICES.search(k) for k in kinds):
            warn_once(
                f"float8 on {', '.join(sorted(kinds))}, which has no float8 matrix units: its "
                f"products are emulated, right and slower than bfloat16's (float8 pays on "
                f"Hopper GPUs and later)"
            )
        options = (("scaling", self.scaling),)
        chosen = self.targets(params, roles)
        return [None if p is None else Hold(p, "float8", options) for p in chosen]


def _product(eqn: Any, ins: list[Any], at: int, hold: Hold) -> Any | None:
    """A ``dot_general`` by a held weight, in float8 (None where the product names its
    output's layout: it runs as it was)."""
    if eqn.params.get("out_sharding") is not None:
        return None
    args = [x.value if i == at else x for i, x in enumerate(ins)]
    return float8_dot_general(*args, eqn.params["dimension_numbers"],
                              scaling=hold.option("scaling", "tensor"),
                              preferred_element_type=eqn.outvars[0].aval.dtype)  # fmt: skip


HELD_RULES.setdefault("float8", {})["dot_general"] = _product
