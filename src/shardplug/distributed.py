"""Many processes, one mesh: joining a ``jax.distributed`` job, and each process's rows.

JAX's multi-controller runtime runs one Python process per host (or per GPU); every process
runs the same program, sees every device of the job in ``jax.devices()`` and its own in
``jax.local_devices()``, and the trainer's mesh spans all of them. Each process feeds only
its own rows of the global batch. On CPU the processes reduce over gloo, which is how
``shardplug launch`` runs a multi-process job on one machine.
"""

from __future__ import annotations

from shardplug.errors import ConfigError, DeviceError

#: how long a process waits for the others to join, and how long the coordinator waits for a
#: silent process before declaring it dead (seconds); both fail with the cause named
JOIN_TIMEOUT_S = 120
HEARTBEAT_TIMEOUT_S = 30


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
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=join_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError) as exc:
        where = f" at {coordinator}" if coordinator else ""
        first = " ".join(str(exc).split())[:300]
        raise DeviceError(
            f"could not join the multi-process job{where} within {join_timeout_s} s "
            f"(process {process_id} of {num_processes}): {first}"
        ) from None


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
