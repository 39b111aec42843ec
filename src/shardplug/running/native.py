"""What the runtime's C++ writes to standard error, sorted for the user: lines that are not
the user's business held back, and XLA's warning that it moved an array between layouts by
gathering it whole said once, in shardplug's words.

These lines are written to file descriptor 2 by C++, past Python's ``sys.stderr`` and
``logging``: ``shardplug launch`` reads its workers' output and sorts it line by line
(:func:`sort`); in one process, :func:`sorted_stderr` points descriptor 2 at a file while
XLA compiles, then sorts what was written. ``SHARDPLUG_TRACEBACK=1`` keeps every line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

#: what gloo says of every connection it makes (one line per device), written in pieces
#: ("[Gloo] Rank ", the rank, " is connected to ", ...) by threads at once: a line may mix
#: the pieces of several in any order, and is gloo's when it holds nothing else (a line
#: of digits alone is the program's)
GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :"
)


def _gloo(line: str) -> bool:
    return GLOO_PIECES.search(line) is not None and not GLOO_PIECES.sub("", line).strip(
        "0123456789 \t\r\n")  # fmt: skip


#: the runtime's native logging (absl/glog lines, stack frames, gRPC's detail): when one
#: process fails, the runtime aborts the others with dozens of these
NATIVE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\]|\*\*\* Check failure stack trace|"
    r"\s+@\s+0x[0-9a-f]+|Additional GRPC error information|:UNKNOWN:|\s*\{grpc_status)"
)
#: absl's notice before the first line a process logs when nothing set absl's logging up
#: (TensorFlow, or a library importing it, loaded by the task)
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written"
#: XLA's SPMD partitioner, when it cannot move an array from one layout to another by a
#: collective of its parts, and gathers it whole on every device instead
REMAT = re.compile(r"\[SPMD\] Involuntary full rematerialization", re.I)
_OPERATION = re.compile(r"HLO operation %\S+ = (\w+\[[\d,]*\])")
_WHERE = re.compile(r'op_name="(?:jit\([^)]*\)/)*([^"]*)"')


def sort(line: str) -> str:
    """What ``line`` is: ``"gloo"``, ``"absl"`` (the notice), ``"remat"`` (XLA's SPMD
    line), ``"native"`` (other native logging), or ``""`` (the program's own)."""
    if _gloo(line):
        return "gloo"
    if line.startswith(ABSL_NOTICE):
        return "absl"
    if REMAT.search(line):
        return "remat"
    return "native" if NATIVE.match(line) else ""


def remat_note(lines: list[str], who: str | None = None) -> str:
    """One line for XLA's ``[SPMD] Involuntary full rematerialization`` ``lines`` (of
    ``who``'s step): what it means, and the first array and operation they name."""
    many = len(lines) > 1
    operation, where = _OPERATION.search(lines[0]), _WHERE.search(lines[0])
    first = ", first" if many else ","
    first += f" {operation.group(1)}" if operation else ""
    first += f" at {where.group(1)}" if where else ""
    return (
        f"shardplug: XLA moved {f'{len(lines)} arrays' if many else 'an array'} between "
        f"layouts by gathering {'each' if many else 'it'} whole on every device and splitting "
        f'it again (its "[SPMD] Involuntary full rematerialization")'
        + (f" in {who}'s step" if who else "")
        + (first if first not in (",", ", first") else "")
        + ": the step computes the same, but each such move costs an all-gather and the "
        "array's whole size on every device: a layout the strategy or the model's code gave "
        "it that the next operation cannot use as it is (SHARDPLUG_TRACEBACK=1 shows XLA's "
        "lines)"
    )


#: the steps whose SPMD lines were already explained in this process
_EXPLAINED: set[str | None] = set()


@contextlib.contextmanager
def sorted_stderr(who: str | None = None) -> Iterator[None]:
    """Hold what is written to file descriptor 2 in the block (XLA compiling a step), then
    write it to ``sys.stderr`` without absl's notice and gloo's connections, its SPMD
    rematerialization lines as one :func:`remat_note` (once per ``who`` in a process),
    and everything else as it was. What another thread writes to standard error meanwhile
    (a progress bar) comes after the block; a process that aborts in the block loses it.
    """
    try:
        saved = -1 if os.environ.get("SHARDPLUG_TRACEBACK") else os.dup(2)
    except OSError:  # no descriptor 2 (a daemon's): nothing to sort
        saved = -1
    if saved < 0:
        yield
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            _replay(held.read().decode(errors="replace"), who)


def _replay(text: str, who: str | None) -> None:
    remat = []
    for line in text.splitlines(keepends=True):
        kind = sort(line)
        if kind == "remat":
            remat.append(line)
        elif kind not in ("gloo", "absl"):
            sys.stderr.write(line)
    if remat and who not in _EXPLAINED:
        _EXPLAINED.add(who)
        sys.stderr.write(remat_note(remat, who) + "\n")
    sys.stderr.flush()


__all__ = ["remat_note", "sort", "sorted_stderr"]
