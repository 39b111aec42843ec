"""Flax Linen: the ``params`` collection trains; the other collections are model state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import PartitionSpec as P

from shardplug.errors import ConfigError
from shardplug.models.adapter import Adapter, Rules


@contextlib.contextmanager
def _metadata_unconstrained() -> Iterator[None]:
    """Initialise without Flax turning partitioning metadata into sharding constraints on
    whatever mesh is current: the names are logical, and the strategy places the arrays (a
    module that reshards in its forward pass is initialised under the run's mesh)."""
    defined = meta.global_mesh_defined
    meta.global_mesh_defined = lambda: False
    try:
        yield
    finally:
        meta.global_mesh_defined = defined


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


class LinenAdapter(Adapter):
    framework = "linen"

    def __init__(
        self,
        module: nn.Module,
        sample_input: Any,
        variables: Mapping[str, Any] | None,
        rng: jax.Array | None,
        init_kwargs: Mapping[str, Any],
        rng_streams: Sequence[str],
        rules: Rules | None,
    ):
        if not isinstance(module, nn.Module):
            raise ConfigError(f"from_linen takes a flax.linen Module, got {type(module).__name__}")
        if variables is None and sample_input is None:
            raise ConfigError("from_linen needs sample_input= (to initialise) or variables=")
        if variables is not None and "params" not in variables:
            raise ConfigError("from_linen variables= must hold a 'params' collection")
        self.module = module
        self.sample_input = sample_input
        self.fixed_rng = rng
        self.init_kwargs = dict(init_kwargs)
        self.rng_streams = tuple(rng_streams)
        self.rules = rules
        self._boxed = None
        if variables is not None:
            self._boxed = jax.eval_shape(lambda: dict(variables))
            self.variables = self._split(dict(variables))

    @property
    def boxed(self) -> Any:
        """The variables' shapes with their partitioning boxes; traced on first use (inside
        the trainer: a module that reshards in its forward pass needs the run's mesh)."""
        if self._boxed is None:
            self._boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        return self._boxed

    def _init_boxed(self, rng):
        with _metadata_unconstrained():
            return dict(self.module.init(rng, self.sample_input, **self.init_kwargs))

    @staticmethod
    def _split(variables):
        with _metadata_unconstrained():
            variables = nn.unbox(variables)
        return variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def init(self, rng):
        if self.variables is not None:
            return self.variables
        # the user's own key, when given, so the first loss equals their loop's
        return self._split(self._init_boxed(rng if self.fixed_rng is None else self.fixed_rng))

    def model_annotations(self, params):
        boxes = jax.tree.leaves(self.boxed["params"], is_leaf=_is_box)
        specs = [P(*b.names) if isinstance(b, nn.Partitioned) else P() for b in boxes]
        if not any(len(s) for s in specs):
            return None
        return jax.tree.unflatten(jax.tree.structure(params), specs)

    def bind(self, params, state, *, rng, train):
        rngs = {name: jax.random.fold_in(rng, i) for i, name in enumerate(self.rng_streams)}
        mutable = list(state) if train else False
        return self.module.bind({"params": params, **state}, rngs=rngs, mutable=mutable)

    def state_of(self, model, state):
        return {k: v for k, v in model.variables.items() if k != "params"}


def from_linen(
    module: nn.Module,
    sample_input: Any = None,
    *,
    variables: Mapping[str, Any] | None = None,
    rng: jax.Array | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
    rng_streams: Sequence[str] = ("dropout",),
    rules: Rules | None = None,
) -> LinenAdapter:
    """Adapt a Flax Linen module for the trainer.

    Either ``sample_input`` (the trainer runs ``module.init(key, sample_input, **init_kwargs)``
    inside its jit, creating each parameter in its sharding; ``rng`` fixes the key, else the
    trainer's seed gives it) or ``variables`` (those your own loop made, so training starts
    exactly where it would have). Collections other than ``params`` (``batch_stats``...) are
    model state, updated in training and read-only in evaluation.

    ``loss_fn`` receives the module bound to the current variables: ``model(x, train=True)``.
    Its random streams (``rng_streams``) are keyed per step: stream ``i`` gets
    ``jax.random.fold_in(step_key, i)``. Partition metadata (``nn.with_partitioning``,
    ``nn.with_logical_partitioning``) gives the annotations; ``rules`` overrides them.
    """
    return LinenAdapter(module, sample_input, variables, rng, init_kwargs or {}, rng_streams, rules)
