"""``shardplug train``: a task (or a reference model, or a pretrained checkpoint) trained with
a strategy chosen by name."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from shardplug.cli.config import RunConfig, read_first, strategy_of, trainer_for
from shardplug.cli.outputs import logged, plot, summary
from shardplug.cli.resume import on_its_devices, ran_on, resumed, saved_run
from shardplug.cli.tasks import task_of
from shardplug.cli.watch import check_memory, quiet_orbax
from shardplug.errors import BatchError, ConfigError


def cmd_train(args: argparse.Namespace) -> int:
    config = _checked(RunConfig.of(args))  # every flag, before JAX starts: a typo costs nothing
    strategy = strategy_of(config)  # an unknown name or option is one line, now
    config, said = on_its_devices(config)  # a plain --resume: where its checkpoint ran
    _join_or_simulate(config)
    quiet_orbax()
    what = task_of(config)  # after the devices: a task file may use JAX as it is imported
    task = what.task
    from shardplug.running.distributed import is_primary

    primary = is_primary()  # process 0 alone writes metrics, progress and the summary
    if config.eval_every is not None and task.eval_data is None:
        raise ConfigError(f"--eval-every: task {task.name} has no eval_data to evaluate on")
    trainer = trainer_for(config, task, strategy, allocate=False)
    if said and primary:
        print(said, file=sys.stderr)
    try:
        _compile_first(config, task, trainer)  # a batch that does not split fails here
    except BatchError as exc:
        raise _replanned(config, exc) from exc
    began = time.perf_counter()
    trainer.allocate()
    if what.pretrained is not None and what.pretrained.tensors is not None:
        _said_read(config, what.pretrained.tensors, trainer, time.perf_counter() - began)
    start = trainer.restore() if config.resume else 0
    if start >= config.steps:
        if primary:
            print(f"shardplug: the checkpoint is at step {start}, already at --steps "
                  f"{config.steps}")  # fmt: skip
        return 0
    _check_profile(config, start)
    if what.optimizer is not None and primary:  # the run's first lines: what it trains with
        print(f"shardplug: optimizer {what.optimizer.describe()}", file=sys.stderr)
    if (config.lora is not None or config.lora_from is not None) and primary:
        print(f"shardplug: lora {task.adapter.describe()}", file=sys.stderr)
    with logged(config, start, primary) as log:
        evaluation = {}
        if config.eval_every is not None:
            held_out = lambda: log.evaluating(_process_share(task.evaluation()))  # noqa: E731
            evaluation = dict(eval_data=held_out, eval_every=config.eval_every,
                              eval_steps=task.eval_steps)  # fmt: skip
        batches = _process_share(task.batches(start))
        history = trainer.fit(batches, steps=config.steps - start, callback=log, **evaluation)
    if not primary:
        return 0
    if not history:
        raise ConfigError(f"task {task.name}: its data gave no batch, so nothing was trained")
    print(summary(config, task, trainer, history, start, _batch_rows(trainer), _processes()))
    if config.plot is not None:
        print(plot(config, task, history))
    return 0


def _checked(config: RunConfig) -> RunConfig:
    """The run's configuration checked, and merged with the checkpoint's on ``--resume``."""
    config = resumed(config, saved_run(config))  # checked against the checkpoint's, and as given
    if config.mesh:
        from shardplug.core.mesh import parse_mesh

        parse_mesh(config.mesh)
    if config.metrics_out is not None and config.metrics_out.is_dir():
        raise ConfigError(f"--metrics-out {config.metrics_out} is a directory: name a file")
    if config.tensorboard is not None and config.tensorboard.is_file():
        raise ConfigError(f"--tensorboard {config.tensorboard} is a file: name a directory")
    return config


def _compile_first(config: RunConfig, task: Any, trainer: Any) -> None:
    """Compile for the task's first batch (where its data can be read twice) and check the
    compiled step's memory, before anything is allocated or written."""
    data = task.batches()  # a function's data is made afresh each time
    if iter(data) is data and not callable(task.data):
        return  # read once only: fit compiles for its first batch
    first = read_first(data, config.data_timeout)
    if first is None:
        return
    trainer.compile(first if _reads_own_rows(task.batches()) else _own_rows(first))
    if not config.skip_memory_check:
        check_memory(trainer)


def _replanned(config: RunConfig, exc: BatchError) -> Exception:
    """A batch that does not split, on ``--resume``: where the batch size is the
    checkpoint's, one line saying which device counts it splits over and what a new batch
    size changes; else the error as it was."""
    ran = ran_on(config)
    saved = saved_run(config) if config.resume else {}
    batch = config.batch_size
    if not ran or batch is None or saved.get("batch_size") != batch:
        return exc
    import re

    devices = ran.get("devices")
    found = re.search(r"over the (\d+) devices", str(exc))
    where = f"the {found.group(1)} devices of this run" if found else "this run's devices"
    counts = [str(n) for n in range(1, min(batch, 64) + 1) if batch % n == 0]
    return ConfigError(
        f"--resume: the checkpoint's global batch of {batch} (its --batch-size, which a "
        f"resumed run keeps: its data position counts batches) does not split over {where}: "
        f"resume on --devices {devices} as it ran, or on a count that divides {batch} "
        f"({', '.join(counts)})"
    )


def _said_read(config: RunConfig, tensors: Any, trainer: Any, seconds: float) -> None:
    from shardplug.core.units import size

    print(
        f"shardplug: read {size(tensors.bytes_read)} of the {size(tensors.nbytes)} in "
        f"{config.init_from} into this process's {len(trainer.mesh.local_devices)} devices "
        f"in {seconds:.1f} s",
        flush=True,
    )


def _check_profile(config: RunConfig, start: int) -> None:
    window = config.profile_steps
    if config.profile_dir is not None and not start <= window.start < config.steps:
        raise ConfigError(
            f"--profile-steps {window.start}:{window.stop}: this run trains steps {start} to "
            f"{config.steps - 1}, so no trace would be written; choose steps among them"
        )


def _batch_rows(trainer: Any) -> int:
    from shardplug.loop.feed import batch_rows

    return batch_rows(trainer.program.signature) * _processes()


def _processes() -> int:
    import jax

    return jax.process_count()


def _own_rows(batch: Any) -> Any:
    """This process's rows of a global batch (all of it in a single process)."""
    import jax

    if _processes() == 1:
        return batch
    from shardplug.running.distributed import process_rows

    rows = process_rows(int(jax.tree.leaves(batch)[0].shape[0]))
    return jax.tree.map(lambda x: x[rows], batch)


def _process_share(data: Any) -> Any:
    """Batches as this process feeds them: a ``shardplug.running.data.Batches`` (or any data with
    Grain's state) reads its own rows; of any other data each process takes its rows."""
    if _processes() == 1 or data is None or _reads_own_rows(data):
        return data
    return (_own_rows(batch) for batch in data)


def _reads_own_rows(data: Any) -> bool:
    from shardplug.loop.position import stateful

    return stateful(iter(data))


def _join_or_simulate(args: RunConfig) -> None:
    """Join the multi-process job the flags describe, or simulate this process's devices."""
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if args.distributed and any(v is not None for v in explicit):
        raise ConfigError("give either --distributed or --coordinator/--num-processes/--process-id")
    if not args.distributed and all(v is None for v in explicit):
        from shardplug.core.devices import simulate_cpu_devices

        simulate_cpu_devices(args.devices)
        return
    from shardplug.core.devices import SIMULATED
    from shardplug.running.distributed import initialize

    if args.distributed:
        initialize()
        return
    count = args.devices or SIMULATED  # CPU devices to simulate, over all the processes
    if args.num_processes is not None and count % args.num_processes:
        given = f"--devices {count}" if args.devices else f"the {count} simulated CPU devices"
        raise ConfigError(
            f"{given} do{'es' * bool(args.devices)} not split over --num-processes "
            f"{args.num_processes}: pass --devices N, a multiple of {args.num_processes}"
        )
    local = None if args.num_processes is None else count // args.num_processes
    initialize(args.coordinator, args.num_processes, args.process_id, local_cpu_devices=local)
