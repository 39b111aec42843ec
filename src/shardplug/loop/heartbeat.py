"""A worker's heartbeat for the launcher that watches it (``launch --stall-seconds``): the
step it dispatched last, written into a file of its own in the folder the launcher names
(``SHARDPLUG_HEARTBEAT``), as each step is dispatched, and as an evaluation or a save
starts and ends (the launcher's limit bounds them too). Before the first step (compiling)
there is no file, and the run's end removes it: a worker without one is not judged. A few
microseconds a step; nothing where no launcher watches."""

from __future__ import annotations

import contextlib
import os

_fd: int | None = None
_path: str | None = None
_failed: str | None = None  # a folder that could not be written: not tried again


def beat(step: int) -> None:
    """Say that ``step`` was dispatched (the file's time and its text)."""
    global _fd, _path, _failed
    folder = os.environ.get("SHARDPLUG_HEARTBEAT")
    if not folder or folder == _failed:
        return
    if _fd is None or not _path or os.path.dirname(_path) != folder:
        end()
        import jax

        path = os.path.join(folder, str(jax.process_index()))
        try:
            _fd, _path = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), path
        except OSError:  # the launcher's folder is gone: it no longer watches
            _failed = folder
            return
    try:
        os.pwrite(_fd, f"{step:<20}".encode(), 0)
    except OSError:
        _failed = folder
        end()


def end() -> None:
    """No step for a while (or none again): the beat removed, not to be judged."""
    global _fd, _path
    if _fd is not None:
        with contextlib.suppress(OSError):
            os.close(_fd)
    if _path is not None:
        with contextlib.suppress(OSError):
            os.unlink(_path)
    _fd = _path = None
