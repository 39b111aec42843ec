"""What Orbax and TensorStore leave behind when a checkpoint cannot be read, kept from the
user: the one line that matters is shardplug's (``SHARDPLUG_TRACEBACK=1`` keeps it all)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def quiet_when_failing() -> Iterator[None]:
    """When Orbax gives up on unreadable files, its pending reads still complete, after the
    read has failed and been reported: into Orbax's closed event loop ("Event loop is
    closed", raised where nobody can catch it), as futures whose exception nobody retrieves
    (asyncio logs each, with its traceback), and as coroutines collected unfinished. Once a
    read starts, those (and only those) are dropped for the rest of the process; the one
    line that matters is the caller's (``SHARDPLUG_TRACEBACK=1`` keeps them)."""
    _drop_stragglers()
    try:
        yield
    except BaseException:
        time.sleep(0.2)  # let the stragglers arrive while the read winds down
        raise


_STRAGGLERS = ("exception was never retrieved", "Event loop is closed", "was never awaited")


def _straggler(text: str) -> bool:
    return any(s in text for s in _STRAGGLERS) or "_read_array" in text or "tensorstore" in text


def _drop_stragglers() -> None:
    if os.environ.get("SHARDPLUG_TRACEBACK") or getattr(_drop_stragglers, "done", False):
        return
    _drop_stragglers.done = True  # type: ignore[attr-defined]
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        said = f"{unraisable.exc_value!r} {unraisable.object!r} {unraisable.err_msg or ''}"
        if _straggler(said):
            return
        previous(unraisable)

    sys.unraisablehook = hook

    class Stragglers(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not _straggler(record.getMessage())

    logging.getLogger("asyncio").addFilter(Stragglers())
    warnings.filterwarnings("ignore", message=r"coroutine '_read_array\w*' was never awaited",
                            category=RuntimeWarning)  # fmt: skip


class _OrbaxBookkeeping(logging.Filter):
    """Orbax's complaint about its own metadata file (its timestamps), which does not stop
    the checkpoint from restoring: not the user's business."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Metadata file" in message and message.startswith("Failed to"))


logging.getLogger("absl").addFilter(_OrbaxBookkeeping())
