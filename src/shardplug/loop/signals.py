"""SIGINT and SIGTERM finish the step, save and stop, agreed across processes."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import numpy as np

from shardplug.loop.waits import DataWait, Interrupted


class StopSignals:
    """While active (in the main thread), SIGINT and SIGTERM ask the loop to stop after the
    current step instead of killing it; a second SIGINT interrupts at once.

    In a multi-process run every process must stop after the same step (a process that ran
    one more step would wait forever in its collectives for the others, who are saving), so
    a signal only takes effect once the processes agree on it, at :meth:`agree`: the loop
    calls it where it reads the metrics, at the same step in every process.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._agreed: int | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}
        #: the loop's :class:`DataWait`: a signal during a wait for data ends that wait
        self.wait: DataWait | None = None

    @property
    def requested(self) -> int | None:
        """The signal to stop for: as received (one process), or as agreed (many)."""
        return self._agreed if self._multi else self.received

    def agree(self) -> None:
        """Share the signals received so far; every process must call it at the same step."""
        if not (self._multi and self.enabled):
            return
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received or 0))
        received = [int(f) for f in np.ravel(flags) if f]
        self._agreed = received[0] if received else None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        # the loop stuck reading data stops at once, alone; in a job of many processes the
        # others are at another step, so the signal waits for the agreement (a wait that
        # never ends is given up after --data-timeout), and the batch being read is kept
        if self.wait is not None and self.wait.waiting and not self._multi:
            raise Interrupted

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
