"""Adapters for the model frameworks, and the reference models with their data.

A reference model is a name (``mlp``, ``classifier``, ``transformer``) bound to a model for
each framework, its loss, and an endless synthetic data set whose loss can truly fall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from shardplug.errors import UnknownModelError
from shardplug.models import mlp, transformer
from shardplug.models.adapters import Adapter, from_nnx

ADAPTERS: dict[str, Callable[[Any], Adapter]] = {"nnx": from_nnx}


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
    """A built-in model: how to build it in each framework, its loss and its data."""

    name: str
    description: str
    builders: dict[str, Callable[..., Any]]
    loss_fn: Callable[[Any, Any], Any]
    batches: Callable[..., Iterator[dict[str, Any]]]
    learning_rate: float
    batch_size: int = 64

    def adapter(self, framework: str = "nnx") -> Adapter:
        """This model in ``framework``, wrapped in that framework's adapter."""
        if framework not in self.builders:
            raise UnknownModelError(
                f"model {self.name!r} has no {framework!r} version; "
                f"adapters: {', '.join(sorted(self.builders))}"
            )
        return ADAPTERS[framework](self.builders[framework])


MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        ReferenceModel(
            "mlp",
            "MLP regressor of y = sum(x^2) + noise",
            {"nnx": mlp.regressor},
            mlp.mse_loss,
            mlp.regression_batches,
            learning_rate=3e-3,
        ),
        ReferenceModel(
            "classifier",
            "MLP classifier of 10 Gaussian clusters, with accuracy",
            {"nnx": mlp.classifier},
            mlp.cross_entropy_loss,
            mlp.classification_batches,
            learning_rate=3e-3,
        ),
        ReferenceModel(
            "transformer",
            "decoder-only transformer LM on a sparse Markov chain",
            {"nnx": transformer.transformer},
            transformer.lm_loss,
            transformer.markov_batches,
            learning_rate=3e-3,
            batch_size=32,
        ),
    )
}


def get_model(name: str) -> ReferenceModel:
    """The reference model called ``name``."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def check_adapter(name: str) -> None:
    """Raise :class:`UnknownModelError` unless ``name`` is a known adapter."""
    if name not in ADAPTERS:
        raise UnknownModelError(
            f"unknown adapter {name!r}; available: {', '.join(sorted(ADAPTERS))}"
        )


__all__ = [
    "ADAPTERS",
    "MODELS",
    "Adapter",
    "ReferenceModel",
    "check_adapter",
    "from_nnx",
    "get_model",
]
