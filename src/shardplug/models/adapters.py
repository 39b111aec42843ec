"""Adapters: a model from any framework, seen by the trainer as pytrees of arrays.

The trainer never touches a framework's module system. It asks an adapter for

- ``init(rng) -> (params, state)``: the trainable parameters and the rest of the model's
  variables (batch statistics, random-number state), traceable so that core can run it under
  ``jax.jit`` with the strategy's output shardings and create every array where it belongs;
- ``annotations(params)``: the model's own partition hints, as logical ``PartitionSpec``s;
- ``bind(params, state)``: the model in its framework's own form, for the user's ``loss_fn``;
- ``state_of(model)``: the non-trainable variables after the ``loss_fn`` ran.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Adapter(abc.ABC):
    """The interface every framework's adapter implements."""

    framework: str = "?"

    #: the model's variables as they already exist (a model passed in built), or None when
    #: the adapter builds them itself in :meth:`init`.
    variables: tuple[Any, Any] | None = None

    @abc.abstractmethod
    def init(self, rng: jax.Array) -> tuple[Any, Any]:
        """Build ``(params, state)`` from a PRNG key; must be traceable."""

    @abc.abstractmethod
    def annotations(self, params: Any) -> Any | None:
        """A logical ``PartitionSpec`` per parameter (``P()``: no hint), or None for no hints."""

    @abc.abstractmethod
    def bind(self, params: Any, state: Any) -> Any:
        """The model in its framework's own form, holding these variables."""

    @abc.abstractmethod
    def state_of(self, model: Any) -> Any:
        """The non-trainable variables of a bound model, after a forward pass updated them."""

    def abstract(self, rng: jax.Array) -> tuple[Any, Any]:
        """``(params, state)`` as ``jax.ShapeDtypeStruct``: shapes and dtypes, no memory."""
        if self.variables is not None:
            return jax.eval_shape(lambda: self.variables)
        return jax.eval_shape(self.init, rng)


def _logical(variable: nnx.Variable) -> P:
    meta = variable.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding"))
    if names is None:
        return P()
    if isinstance(names, NamedSharding):
        return names.spec
    return names if isinstance(names, P) else P(*names)


class NnxAdapter(Adapter):
    """A ``flax.nnx.Module``: ``nnx.Param`` variables train, every other variable is state."""

    framework = "nnx"

    def __init__(self, model: nnx.Module | Callable[[nnx.Rngs], nnx.Module]):
        if isinstance(model, nnx.Module):
            self.factory = None
            self.graphdef, params, state = nnx.split(model, nnx.Param, ...)
            self.variables = (params, state)
        elif callable(model):
            self.factory = model
            with nnx.use_eager_sharding(False):
                abstract = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
            self.graphdef = nnx.graphdef(abstract)
        else:
            raise TypeError(
                "from_nnx takes an nnx.Module or a function rngs -> nnx.Module, "
                f"got {type(model).__name__}"
            )

    def init(self, rng):
        if self.factory is None:
            return self.variables
        # The strategy, not the model's metadata, decides where arrays live: build the
        # variables unsharded inside the trainer's jit, whose out_shardings place them.
        with nnx.use_eager_sharding(False):
            model = self.factory(nnx.Rngs(rng))
        _, params, state = nnx.split(model, nnx.Param, ...)
        return params, state

    def annotations(self, params):
        # Keep every Variable node (with its metadata), holding a spec instead of an array,
        # so the annotations have exactly the structure of the parameters.
        specs = jax.tree.map(
            lambda v: v.replace(_logical(v)), params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        leaves = jax.tree.leaves(specs)
        return specs if any(len(s) for s in leaves) else None

    def bind(self, params, state):
        return nnx.merge(self.graphdef, params, state)

    def state_of(self, model):
        return nnx.split(model, nnx.Param, ...)[2]


def from_nnx(model: nnx.Module | Callable[[nnx.Rngs], nnx.Module]) -> NnxAdapter:
    """Adapt a Flax NNX model for the trainer.

    Pass a function ``rngs -> Module`` (a class works: ``from_nnx(lambda rngs: MLP(rngs=rngs))``)
    to have the trainer create every parameter directly in its sharding from the run's seed.
    Pass a built module to train the parameters it already holds: they are copied into the
    strategy's shardings once.

    Variables carrying NNX sharding metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``)
    give the strategies their annotations; the names are logical axis names.
    """
    return NnxAdapter(model)
