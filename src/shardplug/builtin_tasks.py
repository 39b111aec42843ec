"""The built-in tasks, shipped as any task is: ``--task shardplug.builtin_tasks:digits``.

``mlp``, ``classifier``, ``transformer`` and ``cnn`` are the reference models as tasks (what
``--model NAME`` runs), on synthetic data read through Grain. ``digits`` is a classifier of
the 8x8 handwritten digits that scikit-learn ships (1,797 images, no download), trained on
1,477 of them and evaluated on the 320 it never sees.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardplug.errors import TaskError
from shardplug.models import from_nnx, get_model
from shardplug.running.data import Batches
from shardplug.task import Task

HELD_OUT = 320  # five evaluation batches of 64


def mlp(adapter: str = "nnx", **options: Any) -> Task:
    """The MLP regressor of y = sum(x^2) + noise."""
    return get_model("mlp").task(adapter, **options)


def classifier(adapter: str = "nnx", **options: Any) -> Task:
    """The MLP classifier of 10 Gaussian clusters."""
    return get_model("classifier").task(adapter, **options)


def transformer(adapter: str = "nnx", **options: Any) -> Task:
    """The decoder-only transformer LM on a sparse Markov chain (options ``layers``,
    ``remat``)."""
    return get_model("transformer").task(adapter, **options)


def cnn(adapter: str = "nnx", **options: Any) -> Task:
    """The CNN with BatchNorm and dropout classifying images of bars."""
    return get_model("cnn").task(adapter, **options)


class DigitsMLP(nnx.Module):
    """64 pixels -> 256 -> 256 -> 10 classes."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.middle = nnx.Linear(256, 256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.middle(nnx.relu(self.hidden(x)))))


def digits_loss(model: DigitsMLP, batch: dict[str, jax.Array]):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def digits_records() -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """scikit-learn's digits as records ``{"image": 64 floats in [0, 1], "label"}``: the
    training ones and the held-out ones (a fixed split)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise TaskError(
            "the digits task reads scikit-learn's digits: pip install scikit-learn"
        ) from None
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    records = [
        {"image": (images[i] / 16.0).astype(np.float32), "label": np.int32(labels[i])}
        for i in order
    ]
    return records[HELD_OUT:], records[:HELD_OUT]


def digits(batch_size: int = 64, seed: int = 0, learning_rate: float = 1e-3) -> Task:
    """An MLP on scikit-learn's handwritten digits; ``eval_accuracy`` is held-out accuracy."""
    train, held_out = digits_records()
    evaluation = Batches(held_out, batch_size, shuffle=False, name="digits-test")
    return Task(
        adapter=from_nnx(lambda rngs: DigitsMLP(rngs)),
        loss_fn=digits_loss,
        optimizer=optax.adam(learning_rate),
        data=Batches(train, batch_size, seed=seed, name="digits-train"),
        eval_data=lambda: iter(evaluation),
        eval_steps=HELD_OUT // batch_size,
        name="digits",
    )


__all__ = ["classifier", "cnn", "digits", "mlp", "transformer"]
