"""What a launch does when its job fails, and how it tells a stalled worker: which
processes start again, from which checkpoint, and what it says (:class:`Restarts`); each
worker's heartbeat, a step number in a file of its own touched as each step is dispatched,
and the worker whose heartbeat stopped longest ago (:class:`Beats`)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shardplug.errors import ConfigError

#: the exit code a launch gives a worker it stopped for having stalled
STALLED = -(1 << 16)
#: the environment variable that names a worker's heartbeat folder
HEARTBEAT = "SHARDPLUG_HEARTBEAT"


class Beats:
    """The workers' heartbeats, in a folder of this start's own: each worker writes the step
    it dispatched last into ``<folder>/<rank>`` (:func:`shardplug.loop.heartbeat.beat`). A
    worker has stalled when it has beaten and its beat is older than ``seconds``: a worker
    stuck in a collective, in its data or in the runtime stops beating, and the others,
    waiting for it in the next step's collectives, a step or two later."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ConfigError(f"--stall-seconds {seconds:g}: give a number of seconds above 0")
        self.seconds = seconds
        self.folder = Path(tempfile.mkdtemp(prefix="shardplug-heartbeat-"))

    def start(self) -> None:
        """A new start: the last start's beats forgotten, the folder named to the workers."""
        self.folder.mkdir(parents=True, exist_ok=True)  # a cleaner of /tmp may have taken it
        for old in self.folder.iterdir():
            old.unlink(missing_ok=True)
        os.environ[HEARTBEAT] = str(self.folder)

    def stalled(self, ranks: Sequence[int]) -> tuple[int, int | None] | None:
        """``(rank, its last step)`` of the worker among ``ranks`` whose beat stopped
        longest ago, where one is older than the limit and every one of them beats; else
        None. A worker without a beat has not begun (compiling, reading its first batch) or
        is ending: while one is, the others wait for it, and no one is judged. An evaluation
        or a save beats as it starts and ends: the limit bounds it too."""
        now, stale = time.time(), []
        for rank in ranks:
            try:
                stat = (self.folder / str(rank)).stat()
                text = (self.folder / str(rank)).read_text().strip()
            except OSError:
                return None
            if now - stat.st_mtime > self.seconds:
                stale.append((stat.st_mtime, rank, int(text) if text.isdigit() else None))
        if not stale:
            return None
        _, rank, step = min(stale)
        return rank, step


class Restarts:
    """What a launch does when its job fails: which processes start again, from where, and
    what it says. A job restarts when it failed (not when stopped by a signal or ended well),
    restarts remain, and it keeps checkpoints; every worker resumes from the newest complete
    checkpoint (``--resume`` added once one exists)."""

    def __init__(self, train_args: Sequence[str], nprocs: int, restarts: int,
                 min_nprocs: int | None):  # fmt: skip
        if restarts < 0:
            raise ConfigError(f"--restarts {restarts}: give 0 or more")
        if min_nprocs is not None and not 1 <= min_nprocs <= nprocs:
            raise ConfigError(f"--min-nprocs {min_nprocs}: give 1 to --nprocs ({nprocs})")
        self.train_args, self.full = list(train_args), nprocs
        self.nprocs, self.left, self.min_nprocs = nprocs, restarts, min_nprocs or nprocs
        self.restart = 0
        self.folder = _value(self.train_args, "--checkpoint-dir")
        self.local = _value(self.train_args, "--local-checkpoint-dir")
        self.metrics = _value(self.train_args, "--metrics-out")
        if restarts and self.folder is None:
            raise ConfigError("--restarts resumes from the job's checkpoints: give the train "
                              "command a --checkpoint-dir (and --checkpoint-every)")  # fmt: skip
        self.failures: list[tuple[int, int | None]] = []  # (rank, newest step when it failed)
        self.grow = False
        if min_nprocs is not None and min_nprocs < nprocs:
            signal.signal(signal.SIGUSR1, self._grow)

        self.stop: Callable[[int, object], None] | None = None  # asks this start to stop

    def _grow(self, signum: int, frame: object) -> None:
        """SIGUSR1: every process back. The running workers are asked to stop (they save,
        as on SIGTERM), and the job starts again on all of them."""
        if self.nprocs < self.full and not self.grow and self.stop is not None:
            self.grow = True
            self.stop(signal.SIGTERM, None)

    def args(self) -> list[str]:
        """The train command of this start: ``--resume`` once a checkpoint exists."""
        if self.restart and self._newest() is not None and "--resume" not in self.train_args:
            return [*self.train_args, "--resume"]
        return list(self.train_args)

    def _newest(self) -> int | None:
        from pathlib import Path

        from shardplug.running.checkpoint import complete_steps

        steps = [s for f in (self.folder, self.local) if f for s in complete_steps(Path(f))]
        return max(steps) if steps else None

    def again(self, code: int, failed: tuple[int, int] | None) -> bool:
        """Whether the job starts again, said in one line; adjusts who starts."""
        if self.grow and self.nprocs < self.full:  # told to grow back: not a failure
            self.nprocs, self.grow = self.full, False
            self.restart += 1
            print(f"shardplug: restart {self.restart}: back to {self.full} processes, every "
                  f"worker from the checkpoint of step {self._newest()}", file=sys.stderr,
                  flush=True)  # fmt: skip
            os.environ["SHARDPLUG_RESTART"] = str(self.restart)
            return True
        if code == 0 or failed is None or self.left <= 0:
            return False
        rank, exit_code = failed
        if exit_code == 2:  # bad input: the same again would fail the same way
            return False
        newest = self._newest()
        self.failures.append((rank, newest))
        reached = _last_step(self.metrics)
        at = f" at step {reached}" if reached is not None else ""
        if newest is None:
            where = "from the start (no checkpoint was complete)"
        else:
            redone = ""
            if reached is not None and reached > newest:
                redone = (f": step {reached} is trained again" if reached == newest + 1 else
                          f": steps {newest + 1}-{reached} are trained again")  # fmt: skip
            where = f"from the checkpoint of step {newest}{redone}"
        self.left -= 1
        self.restart += 1
        lost = self._lost(rank, newest)
        if lost:
            self.nprocs -= 1
            going = "1 process goes" if self.nprocs == 1 else f"{self.nprocs} processes go"
            where += (f"; process {rank} failed twice with no checkpoint saved between, so its "
                      f"host is taken as lost: {going} on (SIGUSR1 to the launcher brings it "
                      f"back)")  # fmt: skip
        print(f"shardplug: restart {self.restart}: process {rank} {_how(exit_code)}{at}; "
              f"every worker starts again {where}", file=sys.stderr, flush=True)  # fmt: skip
        os.environ["SHARDPLUG_RESTART"] = str(self.restart)
        return True

    def _lost(self, rank: int, newest: int | None) -> bool:
        if self.nprocs <= self.min_nprocs or len(self.failures) < 2:
            return False
        (before, saved_before), (now, saved_now) = self.failures[-2:]
        return before == now == rank and saved_before == saved_now


def _value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` among a command's arguments (``--flag V`` or ``--flag=V``)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _last_step(metrics: str | None) -> int | None:
    """The last step a run's --metrics-out logged (None without one)."""
    import json

    if metrics is None:
        return None
    try:
        with open(metrics) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _how(code: int) -> str:
    """How a worker ended, in words."""
    if code == STALLED:
        return "stalled"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
