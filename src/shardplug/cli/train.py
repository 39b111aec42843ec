"""``shardplug train``: a reference model with a strategy chosen by name."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from shardplug.cli._common import _quiet_orbax, axis_names, model_options, parse_options
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
)  # taken from the checkpoint


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
    for name in RESUMED:
        if getattr(args, name) is None:
            setattr(args, name, saved.get(name, DEFAULTS.get(name)))
    model = get_model(args.model)
    model.check_options(**model_options(args))
    check_adapter(args.adapter)
    options = parse_options(args.strategy, args.option)
    names = axis_names(args.axis_name)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.metrics_out is not None and args.metrics_out.is_dir():
        raise ConfigError(f"--metrics-out {args.metrics_out} is a directory: name a file")
    _join_or_simulate(args, simulate_cpu_devices)
    _quiet_orbax()

    import optax

    from shardplug.core.mesh import describe
    from shardplug.core.registry import get_strategy
    from shardplug.trainer import Trainer

    batch_size = args.batch_size or model.batch_size
    lr = args.lr or model.learning_rate
    trainer = Trainer(
        model.adapter(args.adapter, **model_options(args)),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(lr),
        strategy=get_strategy(args.strategy, addons=args.addon, axis_names=names, **options),
        devices=args.devices,
        mesh=mesh,
        seed=args.seed,
        log_every=args.log_every,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep or 3,
        config={
            "model": args.model,
            "adapter": args.adapter,
            "seed": args.seed,
            "batch_size": batch_size,
            "lr": lr,
            **model_options(args),
        },
        on_nonfinite=args.on_nonfinite,
        grad_accum=args.grad_accum,
        precision=args.precision,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
    )
    trainer.flops_per_sample = model.flops_per_sample(**model_options(args))
    from shardplug.distributed import is_primary, process_rows

    primary = is_primary()  # process 0 alone writes metrics, progress and the summary
    start = trainer.restore() if args.resume else 0
    if start >= args.steps:
        if primary:
            print(f"shardplug: the checkpoint is at step {start}, already at --steps {args.steps}")
        return 0
    # each process makes only its own rows of every batch
    batches = model.batches(batch_size, args.seed, start=start, rows=process_rows(batch_size))
    first = next(batches)
    trainer.compile(first)  # a batch that does not split fails here, before any output
    out = (
        _open_metrics(args.metrics_out, resume_from=start if args.resume else None)
        if primary
        else None
    )
    try:
        with _Progress(args.quiet or not primary, args.steps, start) as advance:

            def log(rows: list[dict[str, float]]) -> None:
                if out is not None:
                    out.writelines(json.dumps(row) + "\n" for row in rows)
                    out.flush()
                advance(rows)

            history = trainer.fit(
                itertools.chain([first], batches), steps=args.steps - start, callback=log
            )
    finally:
        if out is not None:
            out.close()
    if not primary:
        return 0
    device = trainer.mesh.devices.flat[0].platform
    timed = history[min(args.log_every, len(history) - 1) :] or history
    step_ms = 1000 * sum(r["step_time"] for r in timed) / len(timed)
    resumed = f" from step {start}" if start else ""
    saved_to = f"; saved {trainer.last_checkpoint}" if trainer.checkpoints is not None else ""
    import jax

    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    extras = f" in {args.grad_accum} microbatches" if args.grad_accum > 1 else ""
    extras += ", bf16" if args.precision == "bf16" else ""
    flops = sum(r.get("model_tflops", 0.0) for r in timed) / len(timed)
    rate = f", {flops * 1e3:.2f} model GFLOP/s" if flops else ""
    print(
        f"shardplug: trained {args.model} ({args.adapter}) with {args.strategy} on "
        f"{trainer.mesh.size} {device} devices{processes} ({describe(trainer.mesh)}), "
        f"batch {batch_size}{extras}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"in {len(history)} steps{resumed}; compile {trainer.compile_seconds:.1f} s, "
        f"{step_ms:.1f} ms/step, {batch_size / step_ms * 1000:.0f} samples/s{rate}{saved_to}"
    )
    return 0


def _join_or_simulate(args: argparse.Namespace, simulate: Any) -> None:
    """Join the multi-process job the flags describe, or simulate this process's devices."""
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if args.distributed and any(v is not None for v in explicit):
        raise ConfigError("give either --distributed or --coordinator/--num-processes/--process-id")
    if not args.distributed and all(v is None for v in explicit):
        simulate(args.devices)
        return
    from shardplug.distributed import initialize

    if args.distributed:
        initialize()
        return
    if args.num_processes is not None and args.devices % args.num_processes:
        raise ConfigError(
            f"--devices {args.devices} does not split over --num-processes {args.num_processes}"
        )
    local = None if args.num_processes is None else args.devices // args.num_processes
    initialize(args.coordinator, args.num_processes, args.process_id, local_cpu_devices=local)


def _open_metrics(path: Path | None, resume_from: int | None = None) -> Any:
    """The metrics file, opened for this run. Resuming from step s keeps the rows of steps
    before s (dropping those a killed run logged past its checkpoint, which are run again,
    and any half-written line) and appends."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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
        raise ConfigError(f"cannot write --metrics-out {path}: {exc.strerror}") from None


class _Progress:
    """A rich progress bar on stderr advanced by history rows, or nothing with --quiet."""

    def __init__(self, quiet: bool, total: int, done: int = 0):
        self.quiet, self.total, self.done = quiet, total, done

    def __enter__(self):
        if self.quiet:
            return lambda rows: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            "loss {task.fields[loss]}",
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task("training", total=self.total, completed=self.done, loss="-")

        def advance(rows):
            self.bar.update(task, advance=len(rows), loss=f"{rows[-1]['loss']:.4f}")

        return advance

    def __exit__(self, *exc):
        if not self.quiet:
            self.bar.stop()
