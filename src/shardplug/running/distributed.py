"""Many processes, one mesh: joining a ``jax.distributed`` job, and each process's rows.

JAX's multi-controller runtime runs one Python process per host (or per GPU); every process
runs the same program, sees every device of the job in ``jax.devices()`` and its own in
``jax.local_devices()``, and the trainer's mesh spans all of them. Each process feeds only
its own rows of the global batch. On CPU the processes reduce over gloo, which is how
``shardplug launch`` runs a multi-process job on one machine.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time

from shardplug.errors import ConfigError, DeviceError

#: how long a process waits for the others to join, and how long the coordinator waits for a
#: silent process before declaring it dead (seconds); both fail with the cause named
JOIN_TIMEOUT_S = 60
HEARTBEAT_TIMEOUT_S = 15
#: after this long waiting to join, a process says what it waits for (seconds)
JOIN_NOTICE_S = 5.0
#: how often each process looks for a peer's failure (seconds)
WATCH_INTERVAL_S = 0.25
#: the exit code of a process stopped because another process of its job failed
EXIT_PEER_FAILED = 1

#: how long a failing process waits for the others to read its failure before it exits
#: (seconds): its exit closes its links, and a peer blocked in a collective on one would die
#: in the runtime, unheard, before its watcher had read why
ACK_TIMEOUT_S = 3.0

_FAILED = "shardplug/failed/"  # the coordination service's key for a process's failure
_SEEN = "shardplug/seen/"  # a peer's key: it has read a failure and is stopping
_GONE = "shardplug/gone/"  # a failing process's key: every peer has read it; it exits now
_joined: list[int] = []  # this process's id, once it has joined a job
_stop = threading.Event()  # set at exit: the watcher lets go of the coordination service


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` into its parts; :class:`ConfigError` if it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"coordinator {text!r} is not HOST:PORT (e.g. 10.0.0.1:4321)")
    return host, int(port)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_cpu_devices: int | None = None,
    join_timeout_s: int = JOIN_TIMEOUT_S,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
) -> None:
    """Join a multi-process job; call before anything else touches JAX.

    Give ``coordinator`` (process 0's ``HOST:PORT``), ``num_processes`` and ``process_id``
    together, or none of them to let ``jax.distributed.initialize`` read them from the
    cluster's environment (SLURM, Open MPI, Kubernetes, Cloud TPU). ``local_cpu_devices``
    simulates that many CPU devices in this process, for runs without accelerators; CPU
    collectives then go over gloo.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError(
            "give --coordinator, --num-processes and --process-id together (or none, to "
            "read them from the cluster's environment)"
        )
    if coordinator is not None:
        parse_address(coordinator)
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ConfigError(f"--num-processes must be a positive integer, got {num_processes}")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    import jax

    if local_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", local_cpu_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = f"the coordinator at {coordinator}" if coordinator else "the job's coordinator"
    notice = threading.Timer(JOIN_NOTICE_S, lambda: print(
        f"shardplug: waiting for {where} (process {process_id} of {num_processes}); giving "
        f"up after {join_timeout_s} s", file=sys.stderr, flush=True))  # fmt: skip
    notice.daemon = True
    notice.start()
    try:
        if coordinator is not None and process_id:  # JAX's client aborts the process instead
            _reach(coordinator, join_timeout_s, f"process {process_id} of {num_processes}")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=join_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except DeviceError:
        raise
    except (RuntimeError, ValueError) as exc:
        where = f" at {coordinator}" if coordinator else ""
        first = " ".join(str(exc).split())[:300]
        raise DeviceError(
            f"could not join the multi-process job{where} within {join_timeout_s} s "
            f"(process {process_id} of {num_processes}): {first}"
        ) from None
    finally:
        notice.cancel()
    _joined.append(jax.process_index())
    watcher = threading.Thread(target=_watch_peers, name="shardplug-peers", daemon=True)
    watcher.start()

    def stop_watching() -> None:  # before jax.distributed's own atexit shutdown (LIFO): a
        _stop.set()  # thread inside the service's client as it shuts down aborts the process
        watcher.join(timeout=5)

    atexit.register(stop_watching)


def _reach(coordinator: str, timeout_s: float, who: str) -> None:
    """Wait until something listens at ``coordinator``; :class:`DeviceError` after
    ``timeout_s``. (JAX's client, left to find out, ends the process with a C++ abort.)"""
    host, port = parse_address(coordinator)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise DeviceError(
                    f"could not join the multi-process job at {coordinator} within "
                    f"{timeout_s:g} s ({who}): nothing answers there ({exc.strerror or exc}); "
                    "is process 0 running, and is the address right?"
                ) from None
            time.sleep(0.2)


def joined() -> bool:
    """Whether this process has joined a multi-process job (:func:`initialize`)."""
    return bool(_joined)


def _client():
    from jax._src import distributed  # the coordination service's client (no public name)

    return distributed.global_state.client


def _watch_peers() -> None:
    """End this process within a moment of another one's failure.

    A process that fails tells the coordination service (:func:`leave`); the others are then
    likely blocked in a collective that will never complete, so this thread, not the loop,
    notices, says which process failed and why, and exits at once.
    """
    me = f"{_FAILED}{_joined[0]}"
    while not _stop.wait(WATCH_INTERVAL_S):
        try:
            failed = [(k, v) for k, v in _client().key_value_dir_get(_FAILED) if k != me]
        except Exception:  # the service is gone: the job is ending
            return
        if failed:
            key, why = failed[0]
            print(
                f"shardplug: error: process {key.rsplit('/', 1)[-1]} failed ({why}); stopping "
                f"process {_joined[0]} too",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(Exception):  # the failing process waits for this, then
                _client().key_value_set(f"{_SEEN}{_joined[0]}", key)  # for its own exit
                _await(_GONE, {int(key.rsplit("/", 1)[-1])}, ACK_TIMEOUT_S + 1)
            os._exit(EXIT_PEER_FAILED)


def leave(code: int, why: str = "") -> None:
    """End a process of a multi-process job with ``code``, at once.

    A failure (``code`` != 0) is first told to the other processes, which stop within a
    second (:func:`_watch_peers`) instead of waiting in collectives for this one. The normal
    exit is skipped: ``jax.distributed``'s shutdown would wait at a barrier for processes
    that are not coming.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if code and _joined:
        import jax

        _stop.set()  # this process is the one failing: its watcher names no one else
        with contextlib.suppress(Exception):  # the service is gone: nobody is left to tell
            _client().key_value_set(f"{_FAILED}{_joined[0]}", why or f"exit code {code}")
            others = set(range(jax.process_count())) - {_joined[0]}
            _await((_SEEN, _FAILED), others, ACK_TIMEOUT_S)
            _client().key_value_set(f"{_GONE}{_joined[0]}", "")
    os._exit(code)


def _await(prefixes: str | tuple[str, ...], ranks: set[int], timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the coordination service holds a key under one of
    ``prefixes`` for every process in ``ranks``.

    A failing process waits so for every other to have read its failure (or failed itself),
    and each of them then for it to be gone: whichever process leaves a collective first
    ends the others' in a runtime abort, and the failing process's exit code and every
    process's line saying why must come first."""
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = [k for p in prefixes for k, _ in _client().key_value_dir_get(p)]
        if ranks <= {int(k.rsplit("/", 1)[-1]) for k in keys}:
            return
        time.sleep(0.01)


def process_rows(global_rows: int) -> slice:
    """The rows of a global batch this process feeds: an equal, contiguous block per process,
    in process order (``jax.make_array_from_process_local_data`` assembles the global batch
    from them). One process: every row."""
    import jax

    count, index = jax.process_count(), jax.process_index()
    if global_rows % count:
        raise ConfigError(
            f"the global batch of {global_rows} rows does not split over {count} processes"
        )
    per = global_rows // count
    return slice(index * per, (index + 1) * per)


def is_primary() -> bool:
    """Whether this is the process that writes logs, metrics and progress (process 0)."""
    import jax

    return jax.process_index() == 0
