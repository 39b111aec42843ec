"""Batches read and put on the devices ahead of the loop, in a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class Prefetch:
    """Reads up to ``count`` batches and puts them on the devices in a background thread,
    ``depth`` ahead of the loop: the next batch is on its way while a step runs, and ready
    when the loop comes back from reading the metrics. Errors reach the loop in order."""

    _END = object()

    def __init__(self, batches: Iterable[Any], count: int, place: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(iter(batches), count, place), daemon=True
        )
        self._thread.start()

    def _run(self, batches: Any, count: int, place: Callable) -> None:
        try:
            for i in range(count):
                batch = next(batches, self._END)
                if batch is self._END:
                    break
                if not self._offer(place(batch, i)):
                    return
        except BaseException as exc:  # handed to the loop, raised there
            self._offer(_Failure(exc))
            return
        self._offer(self._END)

    def _offer(self, item: Any) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # stays ended
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)


class _Failure(NamedTuple):
    error: BaseException
