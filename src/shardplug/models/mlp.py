"""The MLP reference models: a regressor on the source tutorial's quadratic target, and a
classifier of Gaussian clusters. Both carry logical-axis annotations (Megatron layout: the
first layer's hidden units and the second layer's inputs are ``mlp``)."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Batch = dict[str, np.ndarray]

_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


def _dense(n_in, n_out, names, rngs):
    return nnx.Linear(
        n_in,
        n_out,
        kernel_init=nnx.with_partitioning(_init, names),
        bias_init=nnx.with_partitioning(_zeros, names[1:]),
        rngs=rngs,
    )


class MLP(nnx.Module):
    """``in -> hidden -> hidden -> out`` with ReLU."""

    def __init__(self, n_in: int, hidden: int, n_out: int, *, rngs: nnx.Rngs):
        self.fc1 = _dense(n_in, hidden, ("embed", "mlp"), rngs)
        self.fc2 = _dense(hidden, hidden, ("mlp", "embed"), rngs)
        self.out = _dense(hidden, n_out, ("embed", None), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.fc1(x))
        x = nnx.relu(self.fc2(x))
        return self.out(x)


# Regressor: y = sum(x^2) + noise, the target of the source tutorial.

REGRESSOR_INPUTS = 16


def regressor(rngs: nnx.Rngs) -> MLP:
    return MLP(REGRESSOR_INPUTS, 128, 1, rngs=rngs)


def regression_batches(batch_size: int, seed: int = 0) -> Iterator[Batch]:
    """Endless batches of ``{"x", "y"}``; batch ``i`` depends only on ``(seed, i)``."""
    step = 0
    while True:
        rng = np.random.default_rng((seed, step))
        x = rng.uniform(-1.0, 1.0, (batch_size, REGRESSOR_INPUTS)).astype(np.float32)
        noise = rng.normal(0.0, 0.05, (batch_size, 1)).astype(np.float32)
        yield {"x": x, "y": np.sum(x**2, axis=1, keepdims=True) + noise}
        step += 1


def mse_loss(model, batch: Batch) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


# Classifier: which of 10 Gaussian clusters a point came from.

CLASSES = 10
CLASSIFIER_INPUTS = 16


def classifier(rngs: nnx.Rngs) -> MLP:
    return MLP(CLASSIFIER_INPUTS, 128, CLASSES, rngs=rngs)


def classification_batches(batch_size: int, seed: int = 0) -> Iterator[Batch]:
    """Endless batches of ``{"x", "label"}``; the cluster centres are the same for every seed."""
    centres = np.random.default_rng(1234).normal(0.0, 1.5, (CLASSES, CLASSIFIER_INPUTS))
    step = 0
    while True:
        rng = np.random.default_rng((seed, step))
        label = rng.integers(0, CLASSES, batch_size)
        x = centres[label] + rng.normal(0.0, 1.0, (batch_size, CLASSIFIER_INPUTS))
        yield {"x": x.astype(np.float32), "label": label.astype(np.int32)}
        step += 1


def cross_entropy_loss(model, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == batch["label"])
    return loss, {"accuracy": accuracy}
