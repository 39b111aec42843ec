"""Equinox: the inexact arrays of the module train; everything else is static."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from shardplug.errors import ConfigError
from shardplug.models.adapter import Adapter, Rules


def _split(built: Any) -> tuple[eqx.Module, Any]:
    model, state = built if isinstance(built, tuple) else (built, None)
    if not isinstance(model, eqx.Module):
        raise ConfigError(
            f"from_equinox needs an eqx.Module (or a function key -> Module or (Module, State)), "
            f"got {type(model).__name__}"
        )
    return model, state


class EquinoxAdapter(Adapter):
    framework = "equinox"

    def __init__(self, model: Any, state: Any, rules: Rules | None):
        self.rules = rules
        if isinstance(model, eqx.Module):
            self.factory = None
            params, self.static = eqx.partition(model, eqx.is_inexact_array)
            self.variables = (params, state)
        elif callable(model):
            self.factory = model
            abstract_model, _ = _split(eqx.filter_eval_shape(model, jax.random.key(0)))
            self.static = eqx.partition(abstract_model, eqx.is_inexact_array)[1]
        else:
            raise ConfigError(
                f"from_equinox takes an eqx.Module or a function key -> Module, "
                f"got {type(model).__name__}"
            )

    def init(self, rng):
        if self.factory is None:
            return self.variables
        model, state = _split(self.factory(rng))
        return eqx.partition(model, eqx.is_inexact_array)[0], state

    def model_annotations(self, params):
        return None  # Equinox arrays carry no metadata: give rules=

    def bind(self, params, state, *, rng, train):
        return eqx.nn.inference_mode(eqx.combine(params, self.static), value=not train)

    def state_of(self, model, state):
        return state  # a stateful loss_fn returns the new eqx.nn.State itself


def from_equinox(model: Any, *, state: Any = None, rules: Rules | None = None) -> EquinoxAdapter:
    """Adapt an Equinox model for the trainer.

    Pass a built ``eqx.Module`` (with its ``eqx.nn.State`` as ``state=`` if it has one), or a
    function ``key -> Module`` or ``key -> (Module, State)`` (``eqx.nn.make_with_state(CNN)``)
    to have the trainer build it, each array in its sharding, from the run's seed.

    Its inexact arrays train; everything else is static. ``loss_fn`` receives the module, in
    inference mode during evaluation. A model with state takes it as ``loss_fn(model, batch,
    state)`` and returns ``(loss, metrics, new_state)``, as Equinox threads state. Equinox
    arrays carry no annotations: ``rules`` maps regular expressions over parameter paths
    (``layers/0/weight``) to logical names (``("mlp", "embed")``).
    """
    return EquinoxAdapter(model, state, rules)
