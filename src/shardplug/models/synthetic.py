"""Synthetic data sets whose loss can truly fall, one per reference model.

Each is an endless iterator of global batches (dicts of NumPy arrays); batch ``i`` depends
only on ``(seed, i)``, so any strategy and device count sees the same data; ``start=i``
begins at batch ``i`` (where a restored run left off), and ``rows=slice(a, b)`` makes only
those rows of each batch (a process's share, in a multi-process run).
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

Batch = dict[str, np.ndarray]

REGRESSION_INPUTS = 16
CLASSES = 10
CLASSIFICATION_INPUTS = 16
VOCAB = 64
SEQ_LEN = 32
IMAGE = 8
IMAGE_CLASSES = 4


def _batches(batch_size, seed, start, rows, make_row):
    """Batch i's rows, each drawn from its own stream ``(seed, i, row)``: any process can
    make just its own rows, and they are the same rows whoever makes them."""
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative integer, got {start!r}")
    wanted = range(batch_size)[rows if rows is not None else slice(None)]
    step = start
    while True:
        made = [make_row(np.random.default_rng((seed, step, row))) for row in wanted]
        yield {key: np.stack([m[key] for m in made]) for key in made[0]}
        step += 1


def _regression_row():

    def row(rng):
        x = rng.uniform(-1.0, 1.0, REGRESSION_INPUTS).astype(np.float32)
        noise = np.float32(rng.normal(0.0, 0.05))
        return {"x": x, "y": np.array([np.sum(x**2) + noise], np.float32)}

    return row


def regression(
    batch_size: int, seed: int = 0, start: int = 0, rows: slice | None = None
) -> Iterator[Batch]:
    """``{"x", "y"}`` with y = sum(x^2) + noise: the source tutorial's quadratic target."""
    return _batches(batch_size, seed, start, rows, _regression_row())


def _clusters_row():
    centres = np.random.default_rng(1234).normal(0.0, 1.5, (CLASSES, CLASSIFICATION_INPUTS))

    def row(rng):
        label = rng.integers(0, CLASSES)
        x = centres[label] + rng.normal(0.0, 1.0, CLASSIFICATION_INPUTS)
        return {"x": x.astype(np.float32), "label": np.int32(label)}

    return row


def clusters(
    batch_size: int, seed: int = 0, start: int = 0, rows: slice | None = None
) -> Iterator[Batch]:
    """``{"x", "label"}``: which of 10 Gaussian clusters (fixed for all seeds) a point is from."""
    return _batches(batch_size, seed, start, rows, _clusters_row())


def _markov_row(sequence: int = SEQ_LEN):
    table = np.random.default_rng(4321)
    successors = np.stack([table.permutation(VOCAB)[:3] for _ in range(VOCAB)])
    cumulative = np.array([0.6, 0.9, 1.0])

    def row(rng):
        seq = np.empty(sequence + 1, dtype=np.int32)
        seq[0] = rng.integers(0, VOCAB)
        choice = np.searchsorted(cumulative, rng.random(sequence), side="right")
        for t in range(sequence):
            seq[t + 1] = successors[seq[t], choice[t]]
        return {"tokens": seq[:-1], "targets": seq[1:]}

    return row


def markov(
    batch_size: int,
    seed: int = 0,
    start: int = 0,
    rows: slice | None = None,
    sequence: int = SEQ_LEN,
) -> Iterator[Batch]:
    """``{"tokens", "targets"}`` of ``sequence`` tokens from a sparse Markov chain (the same
    for every seed); the targets are the tokens shifted by one, made before any split.

    Each token is followed by one of three tokens with probabilities 0.6, 0.3 and 0.1, so
    next-token loss can fall from ln(64) = 4.16 towards the chain's entropy, 0.90 nats.
    """
    return _batches(batch_size, seed, start, rows, _markov_row(sequence))


def _bars_row():
    templates = np.zeros((IMAGE_CLASSES, IMAGE, IMAGE), np.float32)
    templates[0, IMAGE // 2, :] = 1.0
    templates[1, :, IMAGE // 2] = 1.0
    templates[2] = np.eye(IMAGE)
    templates[3] = np.eye(IMAGE)[::-1]

    def row(rng):
        label = rng.integers(0, IMAGE_CLASSES)
        shift = rng.integers(-2, 3)
        image = np.roll(templates[label], shift, axis=(0 if label == 0 else 1))
        image = image + rng.normal(0.0, 0.5, image.shape)
        return {"image": image[..., None].astype(np.float32), "label": np.int32(label)}

    return row


def bars(
    batch_size: int, seed: int = 0, start: int = 0, rows: slice | None = None
) -> Iterator[Batch]:
    """``{"image", "label"}``: 8x8 images of a bar, horizontal, vertical or diagonal, in noise."""
    return _batches(batch_size, seed, start, rows, _bars_row())


ROWS = {"regression": _regression_row, "clusters": _clusters_row, "markov": _markov_row,
        "bars": _bars_row}  # fmt: skip


def records(kind: str, batch_size: int, seed: int = 0, **options: int) -> grain.MapDataset:
    """The same rows as ``kind``'s batches, as an endless Grain data set in batch order:
    record ``r`` is row ``r % batch_size`` of batch ``r // batch_size``; ``options`` are the
    rows' (``markov``'s ``sequence``)."""
    row = ROWS[kind](**options)
    return grain.MapDataset.range(2**62).map(
        lambda r: row(np.random.default_rng((seed, r // batch_size, r % batch_size)))
    )
