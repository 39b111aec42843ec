"""Waits on the user's data, announced and bounded.

A batch that never comes (a stalled reader, a hung network file system) used to leave a run
silent until killed, deaf to SIGTERM. While :class:`DataWait` is active, a read that takes
longer than :data:`NOTICE_S` prints one line saying what it waits for; after ``limit_s`` it
raises :class:`shardplug.errors.BatchError` in the waiting thread; and SIGINT or SIGTERM
while waiting end the wait (:class:`Interrupted`), so the loop can save the steps already
taken and stop. The loop pays two attribute writes per batch; a thread polls.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from shardplug.errors import BatchError
from shardplug.running.waiting import NOTICE_S, announced  # noqa: F401 (its old home)

POLL_S = 0.25
_EXPIRE = signal.SIGUSR1  # sent to the waiting thread when the limit passes


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while waiting for data."""


class DataWait:
    """Announce, bound and let signals end waits for data in the main thread.

    :param limit_s: give up a wait after this long (None: wait, announced, as long as it
        takes).
    :param notice_s: when to say what is being waited for.
    """

    def __init__(self, limit_s: float | None = None, notice_s: float = NOTICE_S):
        self.limit_s, self.notice_s = limit_s, notice_s
        self.since: float | None = None  # when the current wait began
        self.what: str | int = ""
        self._main = threading.current_thread() is threading.main_thread()
        self._closed = threading.Event()
        self._previous: Any = None

    @contextlib.contextmanager
    def on(self, what: str) -> Iterator[None]:
        """Wait for ``what`` (``"batch 12"``) inside: announced and bounded."""
        self.begin(what)
        try:
            yield
        finally:
            self.since = None

    def begin(self, what: str | int) -> None:
        """A wait for ``what`` starts (an int: that batch); :meth:`end` ends it. The loop's
        hot path: two attribute writes, the text made only if the wait is announced."""
        self.what, self.since = what, time.monotonic()

    def end(self) -> None:
        self.since = None

    @property
    def waiting(self) -> bool:
        return self.since is not None

    def _expired(self, signum: int, frame: Any) -> None:
        if self.since is not None:
            waited = time.monotonic() - self.since
            self.since = None
            raise BatchError(
                f"no {self._what()} after {waited:.0f} s: the task's data stopped producing "
                f"batches (the limit is --data-timeout {self.limit_s:g})"
            )

    def _what(self) -> str:
        return f"batch {self.what}" if isinstance(self.what, int) else str(self.what)

    def _watch(self) -> None:
        said = None
        while not self._closed.wait(POLL_S):
            since = self.since
            if since is None:
                said = None
                continue
            waited = time.monotonic() - since
            if waited > self.notice_s and said != since:
                said = since
                limit = f"; giving up after {self.limit_s:g} s" if self.limit_s else ""
                print(
                    f"shardplug: waiting {waited:.0f} s for {self._what()}: the task's data has "
                    f"not produced it{limit}",
                    file=sys.stderr,
                    flush=True,
                )
            if self.limit_s is not None and waited > self.limit_s and self._main:
                signal.pthread_kill(threading.main_thread().ident, _EXPIRE)
                self._closed.wait(1.0)  # one signal per second at most

    def __enter__(self) -> DataWait:
        if self._main and self.limit_s is not None:
            self._previous = signal.signal(_EXPIRE, self._expired)
        self._thread = threading.Thread(target=self._watch, name="shardplug-data-wait", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._thread.join()  # wakes at once: nothing outlives the wait
        if self._previous is not None:
            signal.signal(_EXPIRE, self._previous)
