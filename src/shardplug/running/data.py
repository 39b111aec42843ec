"""Batches from a Grain data set: deterministic, split by process, resumable exactly.

:class:`Batches` turns a data set of records (a ``grain.MapDataset``, or any sequence Grain
can read: a list, an array-record source) into an endless stream of global batches, shuffled
anew each epoch with a fixed seed. In a multi-process run each process reads only its own
rows of every batch. Its iterator's state (Grain's, plus a fingerprint of the data set) goes
into every checkpoint the trainer saves, and ``Trainer.restore`` puts it back, so a resumed
run reads exactly the records the uninterrupted run would have read: the state counts global
batches, so it carries over to another strategy, device count or process count.

A task may also give any iterable of batches; see :class:`shardplug.Task`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np

from shardplug.errors import CheckpointError, ConfigError

#: the most batches read ahead of the training loop, and the bytes they may hold together
READ_AHEAD = 16
READ_AHEAD_BYTES = 256 * 2**20


class Batches:
    """Global batches of ``batch_size`` records from ``records``, through Grain.

    :param records: a ``grain.MapDataset`` or a sequence of records (each a dict or pytree
        of NumPy arrays, or anything ``transform`` turns into one).
    :param batch_size: records per global batch; in a multi-process run each process reads
        ``batch_size / process_count`` of them.
    :param seed: the shuffle's seed; each epoch is a new permutation, the same on every run.
    :param shuffle: False reads the records in order.
    :param transform: applied to each record before batching (Grain's ``map``).
    :param name: names the data set in the fingerprint (and in errors).
    :param process_index, process_count: this process's block of rows; by default JAX's,
        read when iteration starts (after ``jax.distributed.initialize``).

    Iterating starts at batch 0 (or where :meth:`set_state` put it); the iterator has
    Grain's ``get_state`` and ``set_state``, which the trainer uses.
    """

    def __init__(
        self,
        records: grain.MapDataset | Sequence[Any],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[[Any], Any] | None = None,
        name: str = "data",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        dataset = (
            records if isinstance(records, grain.MapDataset) else grain.MapDataset.source(records)
        )
        if len(dataset) < batch_size:
            raise ConfigError(
                f"data set {name!r} has {len(dataset)} records, fewer than one batch of "
                f"{batch_size}"
            )
        self.records, self.batch_size, self.seed, self.name = dataset, batch_size, seed, name
        self._shuffle, self._transform = shuffle, transform
        self._process = (process_index, process_count)
        self.fingerprint = _fingerprint(dataset, batch_size, seed, shuffle, name)

    def _processes(self) -> tuple[int, int]:
        """This process's index and the process count: as given, else JAX's."""
        index, count = self._process
        index = jax.process_index() if index is None else index
        return index, jax.process_count() if count is None else count

    def _dataset(self) -> grain.MapDataset:
        index, count = self._processes()
        if self.batch_size % count:
            raise ConfigError(f"batch_size {self.batch_size} does not split over {count} processes")
        ds = self.records.shuffle(seed=self.seed) if self._shuffle else self.records
        ds = ds.repeat(None)  # endless; each epoch shuffled anew
        if self._transform is not None:
            ds = ds.map(self._transform)
        # Global batch k is blocks k*count .. k*count+count-1; this process reads its own.
        ds = ds.batch(self.batch_size // count, drop_remainder=True)
        return ds[index::count] if count > 1 else ds

    def __iter__(self) -> _Iterator:
        return _Iterator(self)

    def first(self) -> Any:
        """This process's rows of global batch 0, read at once with no read-ahead (what
        planning a step needs: its shapes)."""
        return self._dataset()[0]

    def _read_options(self) -> grain.ReadOptions:
        """Grain's read-ahead, in batches (the elements it reads are whole batches): as many
        as fit in :data:`READ_AHEAD_BYTES`, 1 to :data:`READ_AHEAD`, each read by a thread.
        Grain's default, 500 ahead on 16 threads, held 32 GB of a 1M-token reference batch
        and kept the first batch 38 s behind the 15 others its threads read beside it."""
        record = self.records[0]
        if self._transform is not None:
            record = self._transform(record)
        rows = self.batch_size // self._processes()[1]
        nbytes = rows * sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(record))
        ahead = int(max(1, min(READ_AHEAD, READ_AHEAD_BYTES // max(nbytes, 1))))
        return grain.ReadOptions(num_threads=ahead, prefetch_buffer_size=ahead)

    def __repr__(self) -> str:
        return f"Batches({self.name!r}, {len(self.records)} records, batch {self.batch_size})"


class _Iterator(Iterator[Any]):
    """Grain's iterator, its state tagged with the data set's fingerprint."""

    def __init__(self, batches: Batches):
        self.batches = batches
        dataset = batches._dataset()
        self._it = dataset.to_iter_dataset(batches._read_options()).__iter__()

    def __next__(self) -> Any:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """Where the next batch starts: Grain's state and the data set's fingerprint."""
        return {"grain": self._it.get_state(), "data": self.batches.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a state of :meth:`get_state` (of this data set; else
        :class:`CheckpointError`)."""
        if not isinstance(state, dict) or "grain" not in state:
            raise CheckpointError(
                f"the checkpoint's data state is not of shardplug.running.data.Batches "
                f"({state!r}); resume with the data the run was saved with"
            )
        if state.get("data") != self.batches.fingerprint:
            raise CheckpointError(
                f"the checkpoint's data state is of another data set ({state.get('data')}), "
                f"not of {self.batches!r} ({self.batches.fingerprint}): resume with the data, "
                f"batch size and seed the run was saved with"
            )
        self._it.set_state(state["grain"])


def _fingerprint(dataset: Any, batch_size: int, seed: int, shuffle: bool, name: str) -> str:
    """A short hash of what decides the stream: size, batching, order and the first and last
    records' bytes."""
    digest = hashlib.sha256(repr((name, len(dataset), batch_size, seed, shuffle)).encode())
    for index in (0, len(dataset) - 1):
        for leaf in jax.tree.leaves(dataset[index]):
            digest.update(np.ascontiguousarray(leaf).tobytes())
    return f"{name}:{digest.hexdigest()[:16]}"


__all__ = ["Batches"]
