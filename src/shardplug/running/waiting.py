"""A wait outside the process (a checkpoint written to a slow disk, read from a hung one),
announced in one line when it takes long, and its length said when it ends. The loop's
waits on the user's data (``shardplug.loop.waits``) announce theirs the same way."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

#: after this long waiting, one line says so (seconds)
NOTICE_S = 30.0


@contextlib.contextmanager
def announced(what: str, after_s: float = NOTICE_S) -> Iterator[None]:
    """Say in one line what the code inside waits for, if it takes longer than ``after_s``
    (a checkpoint write on a slow disk, say); and how long it took, when it ends."""
    start, lock, said = time.monotonic(), threading.Lock(), []

    def say() -> None:  # once, by the timer or, where a busy machine ran it late, at the end
        with lock:
            if not said:
                said.append(True)
                print(f"shardplug: waiting {after_s:g} s for {what}", file=sys.stderr, flush=True)

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if time.monotonic() - start > after_s:
            say()
            print(f"shardplug: {what}: done after {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        else:
            with lock:  # the timer, if it runs now, says nothing
                said.append(True)
