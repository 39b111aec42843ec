"""The adapter interface: a model from any framework, seen by the trainer as pytrees.

The trainer never touches a framework's module system. It asks an adapter for

- ``init(rng) -> (params, state)``: the trainable parameters and the rest of the model's
  variables (batch statistics, random-number state), traceable so that core can run it under
  ``jax.jit`` with the strategy's output shardings and create every array where it belongs;
- ``annotations(params)``: partition hints, as logical ``PartitionSpec``s: the model's own,
  overridden by the rules given to the adapter;
- ``bind(params, state, rng=, train=)``: the model in its framework's own form;
- ``state_of(model, state)``: the non-trainable variables after the forward pass.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.sharding import leaf_paths
from shardplug.errors import RuleError

#: regular expression over a parameter's path (``blocks/0/wq``) -> logical names or a spec
Rules = Mapping[str, tuple[str | None, ...] | P]


class Adapter(abc.ABC):
    """The interface every framework's adapter implements."""

    framework: str = "?"

    #: the model's variables as they already exist (a model passed in built), or None when
    #: the adapter builds them itself in :meth:`init`.
    variables: tuple[Any, Any] | None = None

    #: ``weights(shardings) -> params``: the parameters read from elsewhere (a pretrained
    #: checkpoint) straight into the strategy's shardings, instead of :meth:`init`'s; None
    #: for a model that starts from :meth:`init` (or from :attr:`variables`).
    weights: Any = None

    #: partition rules by regular expression over parameter paths; they override the model's
    #: own annotations.
    rules: Rules | None = None

    #: sum the gradient across the batch's shards after each shard's is complete (the step's
    #: per-shard path, :func:`shardplug.core.shard_grads.per_shard_grads`): for a model that
    #: runs on weights made from smaller trained ones (LoRA's merged adapters), whose
    #: gradient the compiler would otherwise sum across devices at the weights' full size.
    reduce_per_shard: bool = False

    def trainable(self, params: Any) -> Any | None:
        """Which parameters train: a tree of bools like ``params`` (a frozen one gets no
        gradient and no optimizer state: see :mod:`shardplug.finetuning.lora`), or None for all."""
        return None

    @abc.abstractmethod
    def init(self, rng: jax.Array) -> tuple[Any, Any]:
        """Build ``(params, state)`` from a PRNG key; must be traceable."""

    @abc.abstractmethod
    def model_annotations(self, params: Any) -> Any | None:
        """The model's own logical spec per parameter (``P()``: no hint), or None for none."""

    @abc.abstractmethod
    def bind(self, params: Any, state: Any, *, rng: jax.Array, train: bool) -> Any:
        """The model in its framework's own form, holding these variables.

        ``rng`` is this step's key (the same on every device); ``train`` is False in
        :meth:`shardplug.Trainer.evaluate`.
        """

    @abc.abstractmethod
    def state_of(self, model: Any, state: Any) -> Any:
        """The non-trainable variables after a forward pass of the bound ``model``."""

    def abstract(self, rng: jax.Array) -> tuple[Any, Any]:
        """``(params, state)`` as ``jax.ShapeDtypeStruct``: shapes and dtypes, no memory."""
        if self.variables is not None:
            return jax.eval_shape(lambda: self.variables)
        return jax.eval_shape(self.init, rng)

    def annotations(self, params: Any) -> Any | None:
        """The strategies' ``annotations``: the model's own, with the rules applied on top."""
        own = self.model_annotations(params)
        if not self.rules:
            return own
        return apply_rules(params, own, self.rules)


def check_parts(adapter: Any, loss_fn: Any, optimizer: Any, error: type, who: str) -> None:
    """Refuse, in one line (an ``error``), a model that is not adapted, a loss that is not a
    function, or an optimizer that is not optax's; ``who`` names the one refusing."""
    if not isinstance(adapter, Adapter):
        raise error(
            f"{who}: adapter must be a shardplug adapter (shardplug.from_nnx(model) and its "
            f"kin), got {type(adapter).__name__}"
        )
    if not callable(loss_fn):
        raise error(f"{who}: loss_fn must be a function loss_fn(model, batch)")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise error(f"{who}: optimizer must be an optax transformation")


def apply_rules(params: Any, annotations: Any | None, rules: Rules) -> Any:
    """Annotate every parameter whose path a rule matches (``re.fullmatch``).

    A rule that matches no parameter, or a parameter that two rules match, raises
    :class:`RuleError`: a silent miss would leave a large array replicated.
    """
    paths = leaf_paths(params)
    leaves = jax.tree.leaves(params)
    own = [P()] * len(leaves) if annotations is None else jax.tree.leaves(annotations)
    compiled = {pattern: re.compile(pattern) for pattern in rules}
    used: set[str] = set()
    specs = []
    for path, leaf, hint in zip(paths, leaves, own, strict=True):
        matched = [p for p, regex in compiled.items() if regex.fullmatch(path)]
        if len(matched) > 1:
            raise RuleError(
                f"parameter {path} matches two rules, {matched[0]!r} and {matched[1]!r}: "
                "make the patterns exclusive"
            )
        if not matched:
            specs.append(hint)
            continue
        used.add(matched[0])
        spec = rules[matched[0]]
        spec = spec if isinstance(spec, P) else P(*spec)
        if len(spec) > len(leaf.shape):
            raise RuleError(
                f"rule {matched[0]!r} gives {path} of shape {tuple(leaf.shape)} the spec {spec}, "
                "which has more entries than the array has dimensions"
            )
        specs.append(spec)
    unused = [p for p in rules if p not in used]
    if unused:
        raise RuleError(
            f"rule {unused[0]!r} matches no parameter; paths look like "
            f"{', '.join(paths[:3])} (patterns must match the whole path)"
        )
    return jax.tree.unflatten(jax.tree.structure(params), specs)
