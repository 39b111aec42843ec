"""``shardplug launch``: N processes of ``shardplug train`` on this machine, one job.

Each worker is told the coordinator (process 0, on a free loopback port), the process count
and its id, and simulates its share of the devices; together they form one global mesh over
``jax.distributed`` with gloo collectives, as hosts of a cluster would. Output is streamed
line by line, prefixed by rank. If a worker fails, the others are stopped within seconds and
the launch exits non-zero naming it; Ctrl-C (or SIGTERM) is passed on to every worker, which
then saves a checkpoint if it keeps them; no worker outlives the launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from shardplug.errors import ConfigError
from shardplug.running import native
from shardplug.running.restarts import STALLED, Beats, Restarts, _how

GRACE_S = 60.0  # how long workers asked to stop (Ctrl-C) get to agree, save and exit
FAILED_GRACE_S = 5.0  # after a worker failed, the others only wait in collectives
EARLY_EXIT_S = 10.0  # a worker that ended well while the others still run this long ended early
EXIT_WORKER_FAILED = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec (Linux)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed if the launcher dies
    except OSError:
        pass


#: the line a worker says when it stops because another one failed
FOLLOWED = re.compile(r"shardplug: error: process \d+ failed \(")
#: how long after the first failed exit the launcher waits for the others' before naming one
#: and stopping them: long enough for each to notice the failure itself (it polls every
#: 0.25 s) and say so, on a loaded machine too (0.5 s was not, on CI's two busy cores, nor
#: was 2 s once in 8 runs there); workers that exit sooner end the wait sooner
SETTLE_S = 5.0


def _stream(rank: int, pipe: IO[str], out: IO[str], lock: threading.Lock, held: list[str],
            said: list[bool], explained: set[str] | None = None,
            followed: set[int] | None = None) -> None:  # fmt: skip
    """Relay a worker's lines, prefixed by its rank; its native lines go to ``held`` (shown
    for a failed worker that said nothing itself), ``said`` notes a line of its own. Gloo's
    connections and absl's notice are dropped; XLA's SPMD rematerialization lines are held
    and said once for the job in shardplug's words (``explained``, shared by the workers)."""
    everything = bool(os.environ.get("SHARDPLUG_TRACEBACK"))
    explained = set() if explained is None else explained
    for line in pipe:
        kind = native.sort(line)
        if kind == "gloo" or (kind == "absl" and not everything):
            continue
        if not everything and kind in ("native", "remat"):
            held.append(line)
            if kind == "remat" and kind not in explained:
                with lock:
                    explained.add(kind)
                    out.write(f"[{rank}] {native.remat_note([line])}\n")
                    out.flush()
            continue
        if line.startswith("shardplug: "):
            said.append(True)
            if followed is not None and FOLLOWED.match(line):
                followed.add(rank)  # it stopped because another failed: not a cause
        with lock:
            out.write(f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
            out.flush()


def worker_command(
    train_args: Sequence[str], rank: int, nprocs: int, devices: int | None, port: int
) -> list[str]:
    """The command of worker ``rank``; ``devices`` (simulated CPU devices of the whole job) is
    left out on a GPU machine, where each worker uses every GPU it is given."""
    return [
        sys.executable,
        "-m",
        "shardplug",
        *train_args,
        *(["--devices", str(devices)] if devices is not None else []),
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(nprocs),
        "--process-id",
        str(rank),
    ]


def check_train_args(train_args: Sequence[str]) -> None:
    if not train_args or train_args[0] != "train":
        raise ConfigError("give the command to run after --, e.g. -- train --strategy fsdp")
    for flag in ("--devices", "--coordinator", "--num-processes", "--process-id"):
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            raise ConfigError(f"launch sets {flag} itself: leave it out of the train arguments")


def gpu_blocks(nprocs: int, gpus: int) -> list[str] | None:
    """Each worker's ``CUDA_VISIBLE_DEVICES`` on a machine with ``gpus`` NVIDIA GPUs (an equal
    block each), or None without GPUs, where the workers simulate CPU devices."""
    if not gpus:
        return None
    if gpus % nprocs:
        raise ConfigError(
            f"--nprocs {nprocs} does not split this machine's {gpus} GPUs evenly: use a "
            f"divisor of {gpus}"
        )
    per = gpus // nprocs
    return [",".join(str(g) for g in range(r * per, (r + 1) * per)) for r in range(nprocs)]


def launch(nprocs: int, devices_per_proc: int, train_args: Sequence[str], *,
           restarts: int = 0, min_nprocs: int | None = None,
           stall_seconds: float | None = None) -> int:  # fmt: skip
    """Run the job; returns the exit code (0 when every worker succeeded).

    On a machine with NVIDIA GPUs each worker gets an equal block of them
    (``CUDA_VISIBLE_DEVICES``) and uses all of its block; without, each simulates
    ``devices_per_proc`` CPU devices.

    :param restarts: how many times a failed job starts again, every worker from the newest
        complete checkpoint of its ``--checkpoint-dir`` (:class:`Restarts`).
    :param min_nprocs: the fewest processes it may go on with: a process that fails twice
        with no checkpoint saved between is taken as lost (its host gone), and the job
        resumes without it, re-planned as ``--resume`` onto fewer devices is; SIGUSR1 to the
        launcher brings the lost ones back.
    :param stall_seconds: a worker whose heartbeat (a step dispatched) stops this long, after
        its first, has stalled (hung in a collective, its data or the runtime): every worker
        is stopped, as when one fails, and the job restarts where restarts remain
        (:class:`~shardplug.running.restarts.Beats`).
    """
    check_train_args(train_args)
    plan = Restarts(train_args, nprocs, restarts, min_nprocs)
    beats = Beats(stall_seconds) if stall_seconds is not None else None
    try:
        while True:
            if beats is not None:
                beats.start()
            code, failed = _job(plan.nprocs, devices_per_proc, plan.args(), plan, beats)
            if not plan.again(code, failed):
                return code
    finally:
        if beats is not None:
            shutil.rmtree(beats.folder, ignore_errors=True)
            os.environ.pop("SHARDPLUG_HEARTBEAT", None)


def _job(nprocs: int, devices_per_proc: int, train_args: Sequence[str],
         plan: Restarts | None = None,
         beats: Beats | None = None) -> tuple[int, tuple[int, int] | None]:  # fmt: skip
    """One start of every worker, supervised to its end: the exit code and the worker that
    failed (None where none did, or a signal stopped them)."""
    from shardplug.core.devices import nvidia_gpus

    held: list[list[str]] = [[] for _ in range(nprocs)]  # each worker's native lines
    said: list[list[bool]] = [[] for _ in range(nprocs)]  # whether it said anything itself
    explained: set[str] = set()  # the native lines said in shardplug's words, for the job
    followed: set[int] = set()  # the workers that said they stop because another failed

    blocks = gpu_blocks(nprocs, nvidia_gpus())
    lock = threading.Lock()
    workers, threads = _start_workers(
        train_args, nprocs, devices_per_proc, blocks, lock, held, said, explained, followed
    )
    exits = _watch_exits(workers)
    signalled: list[tuple[int, float]] = []  # (signal, when)

    def forward(signum, frame):
        again = bool(signalled)  # a second Ctrl-C stops every worker at once, as torchrun does
        signalled.append((signum, time.monotonic()))
        for proc in workers:
            if proc.poll() is None:
                proc.kill() if again else proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    if plan is not None:
        plan.stop = forward
    try:
        failed = _supervise(workers, exits, signalled, followed, lock, beats)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _kill(workers)
        for t in threads:
            t.join(timeout=5)
    code = _exit_code(failed, exits, signalled, held, said)
    if signalled and failed is None:
        return code, None
    bad = [(r, c) for r, c in exits if c != 0]
    return code, failed or (bad[0] if bad else None)


def _start_workers(
    train_args: Sequence[str],
    nprocs: int,
    devices_per_proc: int,
    blocks: list[str] | None,
    lock: threading.Lock,
    held: list[list[str]],
    said: list[list[bool]],
    explained: set[str],
    followed: set[int],
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    """Start the workers, with a coordinator on a free port, each with a thread that relays
    its output (:func:`_stream`)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    workers: list[subprocess.Popen] = []
    threads = []
    for rank in range(nprocs):
        devices = None if blocks else nprocs * devices_per_proc
        cmd = worker_command(train_args, rank, nprocs, devices, port)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env if blocks is None else {**env, "CUDA_VISIBLE_DEVICES": blocks[rank]},
            start_new_session=True,  # Ctrl-C reaches the launcher, which passes it on
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        workers.append(proc)
        t = threading.Thread(
            target=_stream,
            args=(rank, proc.stdout, sys.stdout, lock, held[rank], said[rank], explained, followed),
            daemon=True,
        )
        t.start()
        threads.append(t)
    return workers, threads


def _watch_exits(workers: list[subprocess.Popen]) -> list[tuple[int, int]]:
    """The workers' ``(rank, exit code)``, appended as they exit, in the order they do: when
    one worker dies the others abort moments later, and the first is the cause to name."""
    exits: list[tuple[int, int]] = []
    for rank, proc in enumerate(workers):
        threading.Thread(
            target=lambda r=rank, p=proc: exits.append((r, p.wait())), daemon=True
        ).start()
    return exits


def _supervise(
    workers: list[subprocess.Popen],
    exits: list[tuple[int, int]],
    signalled: list[tuple[int, float]],
    followed: set[int],
    lock: threading.Lock,
    beats: Beats | None = None,
) -> tuple[int, int] | None:
    """Wait for every worker to exit, stopping the others when one fails, ends early or
    stalls (``beats``), and killing them all once a signal's grace is over; returns the
    worker named as the cause."""
    failed: tuple[int, int] | None = None  # the first worker to fail, once the others stop
    ended_well: float | None = None  # when the first worker exited with 0
    first_bad: float | None = None  # when the first worker exited with an error
    checked = time.monotonic()
    while True:
        if beats is not None and failed is None and not signalled and not exits and (
                time.monotonic() > checked + 1.0):  # fmt: skip
            checked = time.monotonic()
            stuck = beats.stalled([r for r, p in enumerate(workers) if p.poll() is None])
            if stuck is not None:
                failed = (stuck[0], STALLED)
                after = f" after step {stuck[1]}" if stuck[1] is not None else ""
                _stop(workers, lock, f"process {stuck[0]} stalled: no step for "
                      f"{beats.seconds:g} s{after}: stopping every process")  # fmt: skip
        # A failure is named before the loop may end: the others can exit within one tick
        # of the first, and the message must not depend on that race.
        done = len(exits) == len(workers)
        bad = [(r, c) for r, c in list(exits) if c != 0]
        if bad and first_bad is None:
            first_bad = time.monotonic()
        settled = done or (first_bad is not None and time.monotonic() > first_bad + SETTLE_S)
        if bad and failed is None and not signalled and settled:
            # of the exits so far, the first that did not stop because another failed
            causes = [(r, c) for r, c in bad if r not in followed]
            failed = (causes or bad)[0]
            _stop(workers, lock, f"process {failed[0]} {_how(failed[1])}: stopping the others")
        well = [(r, c) for r, c in list(exits) if c == 0]
        if well and ended_well is None:
            ended_well = time.monotonic()
        if (not done and failed is None and not signalled and ended_well is not None
                and time.monotonic() > ended_well + EARLY_EXIT_S):  # fmt: skip
            failed = well[0]
            _stop(workers, lock, f"process {failed[0]} {_how(0)} while the others were "
                  "still running: stopping them")  # fmt: skip
        if done:
            return failed
        if signalled and time.monotonic() > signalled[0][1] + GRACE_S:
            _kill(workers)  # they had their chance to save
        time.sleep(0.05)


def _exit_code(
    failed: tuple[int, int] | None,
    exits: list[tuple[int, int]],
    signalled: list[tuple[int, float]],
    held: list[list[str]],
    said: list[list[bool]],
) -> int:
    """The launch's exit code, the failed worker named (with its runtime's last lines if it
    said nothing itself)."""
    if signalled and failed is None:
        return 128 + signalled[0][0]
    bad = [(r, c) for r, c in exits if c != 0]
    if failed or bad:
        rank, code = failed or bad[0]
        if not said[rank] and held[rank]:  # it died in the runtime: its own words
            for line in held[rank][-20:]:
                sys.stdout.write(
                    f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n"
                )
        stopped = "; stopped the others" if failed else ""
        print(f"shardplug: error: process {rank} {_how(code)}{stopped}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    return 0


def _stop(workers: list[subprocess.Popen], lock: threading.Lock, why: str) -> None:
    with lock:
        print(f"shardplug: {why}", file=sys.stderr, flush=True)
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + FAILED_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in workers):
        time.sleep(0.05)
    _kill(workers)


def _kill(workers: list[subprocess.Popen]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.kill()
    for proc in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
