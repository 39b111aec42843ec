"""Synthetic data sets whose loss can truly fall, one per reference model.

Each is an endless iterator of global batches (dicts of NumPy arrays); batch ``i`` depends
only on ``(seed, i)``, so any strategy and device count sees the same data, and
``start=i`` begins at batch ``i`` (where a restored run left off).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Batch = dict[str, np.ndarray]

REGRESSION_INPUTS = 16
CLASSES = 10
CLASSIFICATION_INPUTS = 16
VOCAB = 64
SEQ_LEN = 32
IMAGE = 8
IMAGE_CLASSES = 4


def _rngs(seed: int, start: int) -> Iterator[np.random.Generator]:
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative integer, got {start!r}")
    step = start
    while True:
        yield np.random.default_rng((seed, step))
        step += 1


def regression(batch_size: int, seed: int = 0, start: int = 0) -> Iterator[Batch]:
    """``{"x", "y"}`` with y = sum(x^2) + noise: the source tutorial's quadratic target."""
    for rng in _rngs(seed, start):
        x = rng.uniform(-1.0, 1.0, (batch_size, REGRESSION_INPUTS)).astype(np.float32)
        noise = rng.normal(0.0, 0.05, (batch_size, 1)).astype(np.float32)
        yield {"x": x, "y": np.sum(x**2, axis=1, keepdims=True) + noise}


def clusters(batch_size: int, seed: int = 0, start: int = 0) -> Iterator[Batch]:
    """``{"x", "label"}``: which of 10 Gaussian clusters (fixed for all seeds) a point is from."""
    centres = np.random.default_rng(1234).normal(0.0, 1.5, (CLASSES, CLASSIFICATION_INPUTS))
    for rng in _rngs(seed, start):
        label = rng.integers(0, CLASSES, batch_size)
        x = centres[label] + rng.normal(0.0, 1.0, (batch_size, CLASSIFICATION_INPUTS))
        yield {"x": x.astype(np.float32), "label": label.astype(np.int32)}


def markov(batch_size: int, seed: int = 0, start: int = 0) -> Iterator[Batch]:
    """``{"tokens", "targets"}`` from a sparse Markov chain (the same for every seed).

    Each token is followed by one of three tokens with probabilities 0.6, 0.3 and 0.1, so
    next-token loss can fall from ln(64) = 4.16 towards the chain's entropy, 0.90 nats.
    """
    table = np.random.default_rng(4321)
    successors = np.stack([table.permutation(VOCAB)[:3] for _ in range(VOCAB)])
    cumulative = np.array([0.6, 0.9, 1.0])
    for rng in _rngs(seed, start):
        seq = np.empty((batch_size, SEQ_LEN + 1), dtype=np.int32)
        seq[:, 0] = rng.integers(0, VOCAB, batch_size)
        choice = np.searchsorted(cumulative, rng.random((batch_size, SEQ_LEN)), side="right")
        for t in range(SEQ_LEN):
            seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
        yield {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def bars(batch_size: int, seed: int = 0, start: int = 0) -> Iterator[Batch]:
    """``{"image", "label"}``: 8x8 images of a bar, horizontal, vertical or diagonal, in noise."""
    templates = np.zeros((IMAGE_CLASSES, IMAGE, IMAGE), np.float32)
    templates[0, IMAGE // 2, :] = 1.0
    templates[1, :, IMAGE // 2] = 1.0
    templates[2] = np.eye(IMAGE)
    templates[3] = np.eye(IMAGE)[::-1]
    for rng in _rngs(seed, start):
        label = rng.integers(0, IMAGE_CLASSES, batch_size)
        shift = rng.integers(-2, 3, batch_size)
        images = np.stack(
            [
                np.roll(templates[c], s, axis=(0 if c == 0 else 1))
                for c, s in zip(label, shift, strict=True)
            ]
        )
        images = images + rng.normal(0.0, 0.5, images.shape)
        yield {"image": images[..., None].astype(np.float32), "label": label.astype(np.int32)}
