"""A worker's heartbeat for the launcher that watches it (``launch --stall-seconds``): the
step it dispatched last, written into a file of its own in the folder the launcher names
(``SHARDPLUG_HEARTBEAT``), as each step is dispatched, and removed when the steps end (the
last rows and the save after them are no step). A few microseconds a step; nothing where no
launcher watches."""

from __future__ import annotations

import contextlib
import os

_fd: int | None = None
_folder: str | None = None


def beat(step: int) -> None:
    """Say that ``step`` was dispatched (the file's time and its text)."""
    global _fd, _folder
    folder = os.environ.get("SHARDPLUG_HEARTBEAT")
    if not folder:
        return
    if _fd is None or folder != _folder:
        import jax

        _folder = folder
        path = os.path.join(folder, str(jax.process_index()))
        try:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:  # the launcher's folder is gone: it no longer watches
            _fd = None
            return
    try:
        os.pwrite(_fd, f"{step:<20}".encode(), 0)
    except OSError:
        _fd = None


def end() -> None:
    """The steps ended: no beat to watch until the next run's first."""
    global _fd
    if _fd is None:
        return
    import jax

    os.close(_fd)
    _fd = None
    if _folder:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_folder, str(jax.process_index())))
