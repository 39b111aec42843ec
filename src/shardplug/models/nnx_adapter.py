"""Flax NNX: ``nnx.Param`` variables train; every other variable is model state."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.context import compute_dtype
from shardplug.errors import ConfigError
from shardplug.models.adapter import Adapter, Rules


def _logical(variable: nnx.Variable) -> P:
    meta = variable.get_metadata()
    names = meta.get("out_sharding", meta.get("sharding"))
    if names is None:
        return P()
    if isinstance(names, NamedSharding):
        return names.spec
    return names if isinstance(names, P) else P(*names)


class NnxAdapter(Adapter):
    framework = "nnx"

    def __init__(
        self, model: nnx.Module | Callable[[nnx.Rngs], nnx.Module], rules: Rules | None = None
    ):
        self.rules = rules
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
            raise ConfigError(
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

    def model_annotations(self, params):
        variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        specs = [_logical(v) for v in variables]
        if not any(len(s) for s in specs):
            return None
        return jax.tree.unflatten(jax.tree.structure(params), specs)

    def bind(self, params, state, *, rng, train):
        # NNX models carry their own nnx.Rngs (in ``state``); train() / eval() set dropout's
        # ``deterministic`` and BatchNorm's ``use_running_average``.
        # fresh Variables, owned by the trace the step runs in (BatchStat updates in place)
        model = nnx.merge(self.graphdef, params, state, copy=True)
        model.train() if train else model.eval()
        dtype = compute_dtype()
        if dtype is not None:
            follow_parameters(model, dtype)
        return model

    def state_of(self, model, state):
        return nnx.split(model, nnx.Param, ...)[2]


def follow_parameters(model: nnx.Module, dtype: jax.typing.DTypeLike) -> None:
    """Under mixed precision, every stock layer that did not choose a compute dtype computes
    in ``dtype``, as Flax writes mixed precision (``dtype=bfloat16, param_dtype=float32``).

    Casting the parameters is not enough for NNX: ``nnx.Embed`` fixes its compute dtype when
    it is built (``dtype or embedding.dtype``: float32), and ``nnx.BatchNorm`` with
    ``dtype=None`` promotes to its float32 running averages, so either returns float32 and
    every matrix product downstream promotes to float32. A layer with ``dtype=None``, and an
    ``nnx.Embed`` whose dtype is its parameters', compute in ``dtype`` (statistics stay
    float32 inside the norms); a layer built with another explicit dtype keeps it
    (``explain`` shows where a step computes in float32).
    """
    for _, module in nnx.iter_modules(model):
        if not hasattr(module, "param_dtype") or not hasattr(module, "dtype"):
            continue
        chosen = module.dtype is not None and not (
            isinstance(module, nnx.Embed) and module.dtype == module.param_dtype
        )
        if not chosen:
            module.dtype = dtype


def from_nnx(
    model: nnx.Module | Callable[[nnx.Rngs], nnx.Module], *, rules: Rules | None = None
) -> NnxAdapter:
    """Adapt a Flax NNX model for the trainer.

    Pass a function ``rngs -> Module`` (a class works: ``from_nnx(MLP)``) to have the trainer
    create every parameter directly in its sharding from the run's seed. Pass a built module
    to train the parameters it already holds: they are copied into the strategy's shardings
    once, and the module you passed is left as it was.

    Variables carrying NNX sharding metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``)
    give the strategies their annotations; the names are logical axis names. ``rules`` maps
    regular expressions over parameter paths (``blocks/0/wq``) to logical names and overrides
    them.
    """
    return NnxAdapter(model, rules)
