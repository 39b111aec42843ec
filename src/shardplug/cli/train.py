"""``shardplug train``: a reference model with a strategy chosen by name."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from shardplug.cli._common import (
    _quiet_orbax,
    check_task_flags,
    cli_strategy,
    cli_task,
    first_batch,
    model_options,
    plot_path,
)
from shardplug.cli.watch import Progress, check_memory
from shardplug.errors import CheckpointError, ConfigError

DEFAULTS = {"model": "transformer", "adapter": "nnx", "seed": 0}


RESUMED = (
    "model",
    "adapter",
    "seed",
    "batch_size",
    "lr",
    "layers",
    "remat",
    "sequence",
    "experts",
    "top_k",
    "capacity_factor",
    "capacity_groups",
    "bias_rate",
)  # taken from the checkpoint (a reference model's run; a task's keeps its --task)
#: what shapes the model or its routing: on --resume a flag that disagrees is refused
SHAPING = ("layers", "experts", "top_k", "capacity_factor", "capacity_groups", "bias_rate")
RESUMED_PRETRAINED = (
    "init_from",
    "adapter",
    "seed",
    "batch_size",
    "lr",
    "param_dtype",
    "sequence",
    "data",
    "tokenizer",
)  # a run --init-from a checkpoint's


def _checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Check the checkpoint options before JAX starts; the saved run's settings on --resume."""
    from shardplug.checkpoint import complete_steps, saved_config

    directory = args.checkpoint_dir
    if directory is None:
        for flag, value in (
            ("--resume", args.resume or None),
            ("--checkpoint-every", args.checkpoint_every),
            ("--keep", args.keep),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs --checkpoint-dir")
        return {}
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--checkpoint-dir {directory} is a file: name a directory")
    complete = complete_steps(directory)
    if args.resume:
        if not directory.exists():
            raise CheckpointError(f"--resume: checkpoint directory {directory} does not exist")
        if not complete:
            raise CheckpointError(
                f"--resume: {directory} holds no complete checkpoint (it is empty, or every "
                f"save was cut short); train without --resume to start"
            )
        return saved_config(directory, complete[-1])
    if complete:
        raise ConfigError(
            f"--checkpoint-dir {directory} already holds checkpoints (newest: step "
            f"{complete[-1]}); pass --resume to continue that run, or choose an empty directory"
        )
    return {}


def cmd_train(args: argparse.Namespace) -> int:
    # Validate everything the user typed before JAX starts, so a typo costs nothing.
    from shardplug.core.devices import simulate_cpu_devices
    from shardplug.core.mesh import parse_mesh
    from shardplug.models import check_adapter, get_model

    saved = _checkpoint_settings(args)
    if saved.get("init_from") and args.task is None and args.model is None:
        for name in RESUMED_PRETRAINED:  # resuming a fine-tune: its checkpoint, its text
            if getattr(args, name) is None:
                setattr(args, name, saved.get(name))
    check_task_flags(args)
    if args.task is None and saved.get("task") and args.model is None:
        args.task = saved["task"]  # resuming a task's run
    if args.task is None and args.init_from is None:
        was = saved.get("model") or (saved.get("task") and f"task {saved['task']}")
        if was and args.model is not None and args.model != saved.get("model"):
            raise ConfigError(
                f"--checkpoint-dir {args.checkpoint_dir} holds a run of {was!s}, not of "
                f"--model {args.model}: drop --model to resume it, or choose an empty directory"
            )
        for name in RESUMED:
            given, was = getattr(args, name), saved.get(name, DEFAULTS.get(name))
            if name == "top_k" and was is None and saved.get("experts"):
                was = 2  # the default, which checkpoints before top_k was recorded ran
            if saved and name in SHAPING and given is not None and given != was:
                flag = "--" + name.replace("_", "-")
                had = f"{name} {was}" if was is not None else f"no {name.replace('_', ' ')}"
                raise ConfigError(
                    f"{flag} {given}: the run in {args.checkpoint_dir} was trained with {had}, "
                    f"and a resumed run keeps the model it saved: drop {flag}, or train anew "
                    f"in another --checkpoint-dir"
                )
            if given is None:
                setattr(args, name, was)
        get_model(args.model).check_options(**model_options(args))
        check_adapter(args.adapter)
    elif args.seed is None:
        args.seed = saved.get("seed", 0)
    strategy = cli_strategy(args)  # made once: an unknown name or option is one line, now
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.metrics_out is not None and args.metrics_out.is_dir():
        raise ConfigError(f"--metrics-out {args.metrics_out} is a directory: name a file")
    args.plot = plot_path(args.plot)
    if args.tensorboard is not None and args.tensorboard.is_file():
        raise ConfigError(f"--tensorboard {args.tensorboard} is a file: name a directory")
    _join_or_simulate(args, simulate_cpu_devices)
    _quiet_orbax()

    from shardplug.core.mesh import describe

    task = cli_task(args)  # after the devices: a task file may use JAX as it is imported
    if args.eval_every is not None and task.eval_data is None:
        raise ConfigError(f"--eval-every: task {task.name} has no eval_data to evaluate on")
    if args.task is not None:
        config = {"task": args.task, "seed": args.seed}
    elif args.init_from is not None:
        config = {
            "init_from": str(Path(args.init_from).resolve()), "adapter": args.adapter,
            "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
            "param_dtype": args.param_dtype, "sequence": args.sequence, "data": args.data,
            "tokenizer": str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
        }  # fmt: skip
    else:
        config = {
            "model": args.model, "adapter": args.adapter, "seed": args.seed,
            "batch_size": args.batch_size or get_model(args.model).batch_size,
            "lr": args.lr or get_model(args.model).learning_rate, **model_options(args),
        }  # fmt: skip
        if config.get("experts"):
            config.setdefault("top_k", 2)  # recorded, so that a resume can hold to it
    trainer = task.trainer(
        strategy=strategy,
        devices=args.devices,
        mesh=mesh,
        seed=args.seed,
        log_every=args.log_every,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep or 3,
        config=config,
        on_nonfinite=args.on_nonfinite,
        grad_accum=args.grad_accum,
        precision=args.precision,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
        axis_types=args.axis_types,
        allocate=False,  # compiled and checked against the memory there first
    )
    trainer.peak_tflops = args.peak_tflops
    trainer.data_timeout = args.data_timeout
    first = first_batch(task, args.data_timeout)
    if first is not None:  # a batch that does not split fails here, before any output
        trainer.compile(first if _reads_own_rows(task.batches()) else _own_rows(first))
        if not args.skip_memory_check:
            check_memory(trainer)
    began = time.perf_counter()
    trainer.allocate()
    loaded = getattr(args, "_pretrained", None)
    if loaded is not None and loaded.tensors is not None:  # every process: what it read
        from shardplug.views import size

        print(
            f"shardplug: read {size(loaded.tensors.bytes_read)} of the "
            f"{size(loaded.tensors.nbytes)} in {args.init_from} into this process's "
            f"{len(trainer.mesh.local_devices)} devices in {time.perf_counter() - began:.1f} s",
            flush=True,
        )
    from shardplug.distributed import is_primary

    primary = is_primary()  # process 0 alone writes metrics, progress and the summary
    start = trainer.restore() if args.resume else 0
    if start >= args.steps:
        if primary:
            print(f"shardplug: the checkpoint is at step {start}, already at --steps {args.steps}")
        return 0
    window = trainer.settings.profile_steps
    if args.profile is not None and not start <= window.start < args.steps:
        raise ConfigError(
            f"--profile-steps {window.start}:{window.stop}: this run trains steps {start} to "
            f"{args.steps - 1}, so no trace would be written; choose steps among them"
        )
    batches = _process_share(task.batches(start))
    out = None
    if primary and args.metrics_out is not None:
        out = _Metrics(args.metrics_out, resume_from=start if args.resume else None)
    board = _tensorboard(args.tensorboard) if primary and args.tensorboard else None
    try:
        with Progress(args.quiet or not primary, args.steps, start) as advance:
            evaluation = None
            if args.eval_every is not None:
                evaluation = dict(
                    eval_data=lambda: advance.evaluating(_process_share(task.evaluation())),
                    eval_every=args.eval_every,
                    eval_steps=task.eval_steps,
                )

            def log(rows: list[dict[str, float]]) -> None:
                if out is not None:
                    out.write(rows)
                if board is not None:
                    for row in rows:
                        for key, value in row.items():
                            if key != "step":
                                board.add_scalar(key, value, int(row["step"]))
                    board.flush()
                advance(rows)

            history = trainer.fit(
                batches, steps=args.steps - start, callback=log, **(evaluation or {})
            )
    finally:
        if out is not None:
            out.close()
        if board is not None:
            board.close()
    if not primary:
        return 0
    if not history:
        raise ConfigError(f"task {task.name}: its data gave no batch, so nothing was trained")
    device = trainer.mesh.devices.flat[0].platform
    timed = [r for r in history[min(args.log_every, len(history) - 1) :] if not r.get("skipped")]
    timed = timed or history
    step_ms = 1000 * sum(r["step_time"] for r in timed) / len(timed)
    resumed = f" from step {start}" if start else ""
    saved_to = f"; saved {trainer.last_checkpoint}" if trainer.checkpoints is not None else ""
    import jax

    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    extras = f" in {args.grad_accum} microbatches" if args.grad_accum > 1 else ""
    extras += ", bf16" if trainer.precision in ("bf16", "bfloat16") else ""
    flops = sum(r.get("model_tflops", 0.0) for r in timed) / len(timed)
    rate = f", {flops * 1e3:.2f} model GFLOP/s" if flops else ""
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    rate += f", MFU {100 * sum(mfu) / len(mfu):.1f}%" if mfu else ""
    held_out = [r for r in history if "eval_loss" in r]
    if held_out:
        last = held_out[-1]
        rate += "; held out: " + ", ".join(
            f"{k[5:]} {v:.4f}"
            for k, v in last.items()
            if k.startswith("eval_") and k != "eval_batches"
        )
    if trainer.settings.on_nonfinite == "skip" and trainer.skipped_steps:
        rate += (f"; skipped {trainer.skipped_steps} of {trainer.step} steps whose loss or "
                 "gradient was not finite")  # fmt: skip
    if args.profile is not None:
        window, end = trainer.settings.profile_steps, trainer.step
        if start <= window.start < end:
            where = args.profile / "process_<i>" if jax.process_count() > 1 else args.profile
            saved_to += f"; profile of steps {window.start}-{min(window.stop, end) - 1} in {where}"
        else:
            saved_to += (f"; no profile: its steps {window.start}-{window.stop - 1} were not "
                         f"run (this run ran {start}-{end - 1}; --profile-steps)")  # fmt: skip
    addons = f" + {', '.join(args.addon)}" if getattr(args, "addon", None) else ""
    samples = trainer.batch_shardings and _batch_rows(trainer)
    print(
        f"shardplug: trained {task.name} ({task.adapter.framework}) with {args.strategy}"
        f"{addons} on {trainer.mesh.size} {device} devices{processes} "
        f"({describe(trainer.mesh)}, {trainer.axis_types} axes), "
        f"batch {samples}{extras}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"in {len(history)} steps{resumed}; compile {trainer.compile_seconds:.1f} s, "
        f"{step_ms:.1f} ms/step, {samples / step_ms * 1000:.0f} samples/s{rate}{saved_to}"
    )
    if args.plot is not None:  # the whole run's rows: the metrics file holds a resumed run's
        from shardplug.cli.tools import plot_losses

        rows = history
        if args.metrics_out is not None and args.metrics_out.is_file():
            rows = [json.loads(line) for line in args.metrics_out.read_text().splitlines()]
        print(f"shardplug: drew the losses in {plot_losses(rows, args.plot, task.name)}")
    return 0


def _finite(row: dict[str, float]) -> dict[str, float | None]:
    return {k: v if math.isfinite(v) else None for k, v in row.items()}


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
    from shardplug.distributed import process_rows

    rows = process_rows(int(jax.tree.leaves(batch)[0].shape[0]))
    return jax.tree.map(lambda x: x[rows], batch)


def _process_share(data: Any) -> Any:
    """Batches as this process feeds them: a ``shardplug.data.Batches`` (or any data with
    Grain's state) reads its own rows; of any other data each process takes its rows."""
    if _processes() == 1 or data is None or _reads_own_rows(data):
        return data
    return (_own_rows(batch) for batch in data)


def _reads_own_rows(data: Any) -> bool:
    from shardplug.loop.position import stateful

    return stateful(iter(data))


def _tensorboard(directory: Path) -> Any:
    """A TensorBoard event writer (tensorboardX) into ``directory``."""
    from tensorboardX import SummaryWriter

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write --tensorboard {directory}: {exc.strerror}") from None
    return SummaryWriter(str(directory))


def _join_or_simulate(args: argparse.Namespace, simulate: Any) -> None:
    """Join the multi-process job the flags describe, or simulate this process's devices."""
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if args.distributed and any(v is not None for v in explicit):
        raise ConfigError("give either --distributed or --coordinator/--num-processes/--process-id")
    if not args.distributed and all(v is None for v in explicit):
        simulate(args.devices)
        return
    from shardplug.core.devices import SIMULATED
    from shardplug.distributed import initialize

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


class _Metrics:
    """The --metrics-out file, rewritten when the run logs its first rows, not before: a run
    refused once training starts (another data set, other batch shapes: refusals that come
    in ``fit``) leaves it as it was. Whether it can be written is checked now, changing
    nothing."""

    def __init__(self, path: Path, resume_from: int | None):
        self.path, self.resume_from, self.file = path, resume_from, None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.open("a").close()  # opened to append, nothing written
            made = resume_from is not None or not path.exists()  # a resume's rewrite: made
            if made and not os.access(path.parent, os.W_OK):  # beside it, then moved onto it
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as exc:
            raise _unwritable(path, exc) from None

    def write(self, rows: list[dict[str, float]]) -> None:
        """Strict JSON lines: a NaN or infinite value is null."""
        if self.file is None:
            self.file = _open_metrics(self.path, self.resume_from)
        self.file.writelines(json.dumps(_finite(row), allow_nan=False) + "\n" for row in rows)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"cannot write --metrics-out {path}: {exc.strerror}")


def _open_metrics(path: Path, resume_from: int | None) -> Any:
    """The metrics file, opened for this run. Resuming from step s keeps the rows of steps
    before s (dropping those a killed run logged past its checkpoint, which are run again,
    and any half-written line) and appends."""
    try:
        if resume_from is None or not path.exists():
            return path.open("w")
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if line.endswith("\n") and isinstance(row, dict) and row.get("step", -1) < resume_from:
                kept.append(line)
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        partial.replace(path)
        return path.open("a")
    except OSError as exc:
        raise _unwritable(path, exc) from None
