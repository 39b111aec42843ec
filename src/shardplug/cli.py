"""The ``shardplug`` command line: list strategies, train with one chosen by name, export.

Every bad input ends in one line on stderr, ``shardplug: error: ...``, and exit code 2; a
run stopped by a non-finite loss exits 1; one stopped by SIGINT or SIGTERM (after saving)
exits 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from shardplug.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    ShardplugError,
    ShardplugWarning,
    StrategyOptionError,
    TrainingInterrupted,
)

EXIT_FAILED = 1  # training failed (a non-finite loss)
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line that points to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"shardplug: error: {message} (see {self.prog} --help)\n")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def _memory(text: str) -> int:
    """``80GB``, ``512MiB``, ``1.5e9``: a size in bytes."""
    import re

    match = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB or 512MiB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def _model_arguments(parser: argparse.ArgumentParser, trainer_options: bool = True) -> None:
    """The options that say what to compile: model, adapter, devices, batch; and with
    ``trainer_options`` the strategy's options, add-ons, mesh, microbatches and precision."""
    parser.add_argument("--model", default="transformer", help="reference model (transformer)")
    parser.add_argument("--adapter", default="nnx", help="nnx, linen or equinox (default nnx)")
    parser.add_argument(
        "--devices", type=_positive(int), default=8, help="devices (simulated CPU ones: 8)"
    )
    parser.add_argument("--batch-size", type=_positive(int), default=None, help="global batch")
    parser.add_argument("--seed", type=int, default=0)
    if trainer_options:
        parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                            help="a strategy option (repeatable)")  # fmt: skip
        parser.add_argument("--addon", action="append", default=[], metavar="NAME")
        parser.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,model=4")
        parser.add_argument("--grad-accum", type=_positive(int), default=1, metavar="K")
        parser.add_argument("--precision", choices=("float32", "bf16"), default="float32")


def _step_range(text: str) -> range:
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B, got {text!r}")
    return range(start, stop)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardplug", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    strategies = sub.add_parser("strategies", help="list the installed strategies")
    strategies.add_argument("--json", action="store_true", help="print JSON instead of a table")
    strategies.add_argument(
        "--all",
        action="store_true",
        help="also add-ons and plugins that failed to load, with hooks and errors",
    )

    train = sub.add_parser(
        "train",
        help="train a reference model with a strategy",
        description="Train a reference model on simulated or real devices. "
        "With no options: the transformer LM, data parallel, 8 simulated CPU devices.",
    )
    train.add_argument("--strategy", default="dp", help="strategy name (default: dp)")
    train.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option, e.g. -o min_size=0 for fsdp (repeatable)",
    )
    train.add_argument(
        "--addon",
        action="append",
        default=[],
        metavar="NAME",
        help="an add-on plugin that wraps the strategy's hooks (repeatable)",
    )
    train.add_argument(
        "--model",
        default=None,
        help="mlp, classifier, transformer or cnn (default: transformer, or the checkpoint's)",
    )
    train.add_argument(
        "--adapter",
        default=None,
        help="model framework: nnx, linen or equinox (default: nnx, or the checkpoint's)",
    )
    train.add_argument(
        "--steps",
        type=_positive(int),
        default=100,
        help="train to this step; with --resume, counting the steps already taken (default 100)",
    )
    train.add_argument("--batch-size", type=_positive(int), default=None, help="global batch size")
    train.add_argument(
        "--devices",
        type=_positive(int),
        default=8,
        help="devices to use; without an accelerator, simulated CPU devices (default 8)",
    )
    train.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,model=4")
    train.add_argument("--seed", type=int, default=None, help="(default 0, or the checkpoint's)")
    train.add_argument("--lr", type=_positive(float), default=None, help="Adam learning rate")
    train.add_argument("--log-every", type=_positive(int), default=10)
    train.add_argument(
        "--metrics-out",
        type=Path,
        default=None,
        help="JSON lines, one per step (appended to with --resume)",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    speed = train.add_argument_group("speed")
    speed.add_argument(
        "--grad-accum",
        type=_positive(int),
        default=1,
        metavar="K",
        help="microbatches per step, inside the compiled step: the update of the whole "
        "batch with the activation memory of 1/K of it (default 1)",
    )
    speed.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        default="float32",
        help="bf16: bfloat16 forward and backward, float32 parameters and optimizer state",
    )
    speed.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a profiler trace of --profile-steps here (TensorBoard, Perfetto)",
    )
    speed.add_argument(
        "--profile-steps",
        type=_step_range,
        default=range(3, 6),
        metavar="A:B",
        help="the steps to trace, from A to B-1 (default 3:6)",
    )
    ckpt = train.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save checkpoints here (asynchronously, each device its own shards); "
        "SIGINT/SIGTERM then save and stop",
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=_positive(int),
        default=None,
        help="steps between checkpoints (default: only at the end)",
    )
    ckpt.add_argument(
        "--keep", type=_positive(int), default=None, help="checkpoints to keep (default 3)"
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest good checkpoint in --checkpoint-dir, with the "
        "checkpoint's model, adapter, seed and batch size unless given; the strategy, "
        "devices and mesh may differ",
    )
    ckpt.add_argument(
        "--on-nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="a NaN/inf loss: stop with the step and last good checkpoint "
        "named (default), or skip the update and count it",
    )

    multi = train.add_argument_group(
        "multi-process (jax.distributed)",
        "Join a job of many processes, one global mesh: give all three, or --distributed to "
        "read them from the cluster's environment (SLURM, Open MPI, Cloud TPU). --devices is "
        "then the job's total; each process feeds its own rows of every batch.",
    )
    multi.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT", help="process 0's address"
    )
    multi.add_argument("--num-processes", type=_positive(int), default=None)
    multi.add_argument("--process-id", type=int, default=None)
    multi.add_argument(
        "--distributed",
        action="store_true",
        help="join the job the environment describes (jax.distributed.initialize())",
    )

    launch = sub.add_parser(
        "launch",
        help="run a command as N processes of one job on this machine",
        description="Start N processes with a coordinator on a free loopback port, each "
        "with its share of the devices, as one jax.distributed job; output prefixed by rank. "
        "Example: shardplug launch --nprocs 2 --devices-per-proc 4 -- train --strategy fsdp",
    )
    launch.add_argument("--nprocs", type=_positive(int), required=True, help="processes to start")
    launch.add_argument(
        "--devices-per-proc",
        type=_positive(int),
        default=4,
        help="simulated CPU devices per process (default 4)",
    )
    launch.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- train ...")

    explain = sub.add_parser(
        "explain",
        help="what a strategy costs: memory per device, collectives, layout (nothing runs)",
        description="Compile the training step without running it and report each "
        "parameter's layout, the bytes per device (from the compiled step's memory analysis), "
        "the collectives per step next to the textbook figures, and pictures of the layout.",
    )
    _model_arguments(explain)
    explain.add_argument("--strategy", default="dp", help="strategy name (default: dp)")
    explain.add_argument("--param", default=None, help="parameter to picture (default: largest)")
    explain.add_argument(
        "--device-memory", type=_memory, default=None, metavar="SIZE",
        help="the device's memory, e.g. 80GB, to compare the peak against",
    )  # fmt: skip
    explain.add_argument("--plot", type=Path, default=None, metavar="FILE", help="PNG picture")
    explain.add_argument("--json", action="store_true", help="print JSON instead of tables")

    recommend = sub.add_parser(
        "recommend",
        help="which installed strategies fit in the device's memory, and which to use",
        description="Compile the step with every installed strategy, read its peak memory per "
        "device and its communication per step, and recommend: of those that fit, data "
        "parallel when it fits (one all-reduce per step), else the one that sends least.",
    )
    _model_arguments(recommend)
    recommend.add_argument(
        "--device-memory", type=_memory, required=True, metavar="SIZE",
        help="each device's memory, e.g. 80GB or 512MiB",
    )  # fmt: skip
    recommend.add_argument("--json", action="store_true", help="print JSON instead of a table")

    bench = sub.add_parser(
        "bench",
        help="time strategies side by side against the same step written by hand in JAX",
        description="Interleaved rounds of every strategy, of the same step written by hand "
        "(jax.jit with the same shardings), of Flax's nnx.jit loop and of one device: compile "
        "time, median step, throughput, peak memory, and the ratio shardplug / hand-written.",
    )
    _model_arguments(bench, trainer_options=False)
    bench.add_argument(
        "--strategies",
        default="dp,fsdp,2d,pmap",
        help="comma-separated built-ins, which have hand-written twins (default: all four)",
    )
    bench.add_argument("--steps", type=_positive(int), default=20, help="steps per round")
    bench.add_argument("--rounds", type=_positive(int), default=7, help="interleaved rounds")
    bench.add_argument("--plot", type=Path, default=None, metavar="FILE", help="PNG of the bars")
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")

    export = sub.add_parser(
        "export",
        help="write a checkpoint's weights to an .npz for inference",
        description="Write the full parameters and model state of a checkpoint to a NumPy "
        ".npz file (load it with shardplug.load_model).",
    )
    export.add_argument("--checkpoint-dir", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True, help="the .npz file to write")
    export.add_argument(
        "--step", type=_positive(int), default=None, help="which checkpoint (default: newest)"
    )
    return parser


def _convert(option: Any, text: str) -> Any:
    kind = option.type
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if kind in ("int", "float", "str"):
            return {"int": int, "float": float, "str": str}[kind](text)
        if kind.startswith("Sequence") or kind.startswith("tuple"):
            return tuple(part.strip() for part in text.split(",") if part.strip())
        return json.loads(text)
    except ValueError:
        raise StrategyOptionError(f"option {option.name}={text!r} is not a valid {kind}") from None


def parse_options(strategy: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``["min_size=0"]`` into ``{"min_size": 0}``, typed by the strategy's own signature."""
    from shardplug.core.registry import get_strategy, list_strategies

    infos = {i.name: i for i in list_strategies()}
    if strategy not in infos:
        get_strategy(strategy)  # raises the error that lists the names
    known = {o.name: o for o in infos[strategy].options}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise StrategyOptionError(f"strategy option {pair!r} is not KEY=VALUE")
        if key not in known:
            takes = ", ".join(sorted(known)) or "none"
            raise StrategyOptionError(
                f"strategy {strategy!r} has no option {key!r}; its options: {takes}"
            )
        options[key] = _convert(known[key], text)
    return options


def cmd_strategies(args: argparse.Namespace) -> int:
    from shardplug.core.registry import list_addons, list_strategies

    kinds = [("strategy", info) for info in list_strategies(include_broken=args.all)]
    if args.all:
        kinds += [("add-on", info) for info in list_addons(include_broken=True)]
    if args.json:
        rows = [
            {
                "name": i.name,
                "kind": kind,
                "description": i.description,
                "source": i.source,
                "package": i.package,
                "version": i.version,
                "options": {o.name: repr(o.default) for o in i.options},
                "hooks": list(i.hooks),
                "error": i.error,
            }
            for kind, i in kinds
        ]
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    if args.all:
        table = Table("name", "kind", "source", "hooks", "error")
        for kind, i in kinds:
            table.add_row(i.name, kind, i.source, ", ".join(i.hooks), i.error or "")
    else:
        table = Table("strategy", "description", "source", "options")
        for _, i in kinds:
            table.add_row(i.name, i.description, i.source, ", ".join(o.name for o in i.options))
    Console().print(table)
    return 0


DEFAULTS = {"model": "transformer", "adapter": "nnx", "seed": 0}
RESUMED = ("model", "adapter", "seed", "batch_size", "lr")  # taken from the checkpoint


def _checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Check the checkpoint options before JAX starts; the saved run's settings on --resume."""
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
    complete = _complete_checkpoints(directory)
    if args.resume:
        if not directory.exists():
            raise CheckpointError(f"--resume: checkpoint directory {directory} does not exist")
        if not complete:
            raise CheckpointError(
                f"--resume: {directory} holds no complete checkpoint (it is empty, or every "
                f"save was cut short); train without --resume to start"
            )
        return _saved_config(directory, complete[-1])
    if complete:
        raise ConfigError(
            f"--checkpoint-dir {directory} already holds checkpoints (newest: step "
            f"{complete[-1]}); pass --resume to continue that run, or choose an empty directory"
        )
    return {}


def _complete_checkpoints(directory: Path) -> list[int]:
    """Orbax commits a checkpoint by renaming its temporary directory to the step number."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _saved_config(directory: Path, step: int) -> dict[str, Any]:
    """The configuration in the newest checkpoint's JSON (best effort: a damaged one is
    reported by the restore, which falls back to an older checkpoint)."""
    try:
        with open(directory / str(step) / "meta" / "metadata") as f:
            config = json.load(f).get("config", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return config if isinstance(config, dict) else {}


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
    check_adapter(args.adapter)
    options = parse_options(args.strategy, args.option)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.metrics_out is not None and args.metrics_out.is_dir():
        raise ConfigError(f"--metrics-out {args.metrics_out} is a directory: name a file")
    _join_or_simulate(args, simulate_cpu_devices)
    _quiet_orbax()

    import optax

    from shardplug.core.mesh import describe
    from shardplug.core.registry import get_strategy
    from shardplug.core.trainer import Trainer

    batch_size = args.batch_size or model.batch_size
    lr = args.lr or model.learning_rate
    trainer = Trainer(
        model.adapter(args.adapter),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(lr),
        strategy=get_strategy(args.strategy, addons=args.addon, **options),
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
        },
        on_nonfinite=args.on_nonfinite,
        grad_accum=args.grad_accum,
        precision=args.precision,
        profile_dir=args.profile,
        profile_steps=args.profile_steps,
    )
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
    print(
        f"shardplug: trained {args.model} ({args.adapter}) with {args.strategy} on "
        f"{trainer.mesh.size} {device} devices{processes} ({describe(trainer.mesh)}), "
        f"batch {batch_size}{extras}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"in {len(history)} steps{resumed}; compile {trainer.compile_seconds:.1f} s, "
        f"{step_ms:.1f} ms/step, {batch_size / step_ms * 1000:.0f} samples/s{saved_to}"
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


def cmd_launch(args: argparse.Namespace) -> int:
    from shardplug.launch import launch

    command = list(args.command_args)
    if command and command[0] == "--":
        command = command[1:]
    return launch(args.nprocs, args.devices_per_proc, command)


def _quiet_orbax() -> None:
    """Orbax reports routine events as absl warnings; the command line prints its own."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_orbax()
    from shardplug.export import export_checkpoint, load_exported

    path = export_checkpoint(args.checkpoint_dir, args.out, step=args.step)
    arrays, info = load_exported(path)
    total = sum(a.size for name, a in arrays.items() if name.startswith("params/"))
    print(
        f"shardplug: exported step {info['step']} of {args.checkpoint_dir}: "
        f"{total:,} parameters in {len(arrays)} arrays to {path}"
    )
    return 0


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


def _compiled_trainer(args: argparse.Namespace, strategy: str, options: dict[str, Any]):
    """A trainer of the reference model with ``strategy``, its step compiled; and its batch."""
    import optax

    from shardplug.core.registry import get_strategy
    from shardplug.core.trainer import Trainer
    from shardplug.models import get_model

    model = get_model(args.model)
    trainer = Trainer(
        model.adapter(args.adapter),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=get_strategy(strategy, addons=args.addon, **options),
        devices=args.devices,
        mesh=args.mesh,
        seed=args.seed,
        grad_accum=args.grad_accum,
        precision=args.precision,
    )
    batch = next(model.batches(args.batch_size or model.batch_size, args.seed))
    return trainer, batch


def _prepare(args: argparse.Namespace) -> None:
    """Check the model and adapter, then give JAX its simulated devices."""
    from shardplug.core.devices import simulate_cpu_devices
    from shardplug.models import check_adapter, get_model

    get_model(args.model)
    check_adapter(args.adapter)
    if getattr(args, "mesh", None):
        from shardplug.core.mesh import parse_mesh

        parse_mesh(args.mesh)
    simulate_cpu_devices(args.devices)


def _console():
    from rich.console import Console

    return Console(width=max(100, shutil.get_terminal_size().columns))


def cmd_explain(args: argparse.Namespace) -> int:
    options = parse_options(args.strategy, args.option)
    _prepare(args)
    from shardplug.explain import explain, plot, render

    trainer, batch = _compiled_trainer(args, args.strategy, options)
    report = explain(trainer, batch, device_memory=args.device_memory, param=args.param)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        render(report, _console())
    if args.plot is not None:
        plot(report, str(args.plot))
        if not args.json:
            print(f"shardplug: wrote {args.plot}")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    _prepare(args)
    from shardplug.core.registry import list_strategies
    from shardplug.explain import explain, size

    rows = []
    for info in list_strategies():
        try:
            trainer, batch = _compiled_trainer(args, info.name, {})
            report = explain(trainer, batch, device_memory=args.device_memory)
        except ShardplugError as exc:  # a strategy that cannot run this model here
            rows.append({"strategy": info.name, "fits": False, "error": str(exc)})
            continue
        peak = report.per_device["peak_bytes"]
        rows.append({
            "strategy": info.name,
            "fits": peak is not None and peak <= args.device_memory,
            "peak_bytes": peak,
            "params_bytes": report.per_device["params_bytes"],
            "opt_state_bytes": report.per_device["opt_state_bytes"],
            "sent_bytes": report.wire_bytes(),
            "collectives": sum(c["count"] for c in report.collectives),
        })  # fmt: skip
    fitting = [r for r in rows if r["fits"]]
    choice, reason = None, "no installed strategy fits: add devices, or shrink the batch or model"
    if fitting:
        dp = next((r for r in fitting if r["strategy"] == "dp"), None)
        choice = dp or min(fitting, key=lambda r: (r["sent_bytes"], r["peak_bytes"]))
        if dp:
            reason = (
                f"the model fits on each device ({size(dp['peak_bytes'])} of "
                f"{size(args.device_memory)}), so data parallel: the least communication that "
                f"splits the batch, one all-reduce of the gradients ({size(dp['sent_bytes'])} "
                f"sent per device per step)"
            )
        else:
            reason = (
                f"data parallel does not fit; of those that do, {choice['strategy']} sends the "
                f"least per step ({size(choice['sent_bytes'])} per device) at a peak of "
                f"{size(choice['peak_bytes'])} of {size(args.device_memory)}"
            )
    if args.json:
        recommended = choice["strategy"] if choice else None
        print(json.dumps({"strategies": rows, "recommended": recommended, "reason": reason},
                         indent=1))  # fmt: skip
        return 0
    from rich.table import Table

    table = Table(
        title=f"{args.model} ({args.adapter}) on {args.devices} devices of "
        f"{size(args.device_memory)}",
        title_justify="left",
    )
    for column in ("strategy", "fits", "peak/device", "params+opt/device", "sent/step"):
        table.add_column(column, justify="left" if column in ("strategy", "fits") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["strategy"], "no", "", "", r["error"])
            continue
        table.add_row(
            r["strategy"], "yes" if r["fits"] else "no", size(r["peak_bytes"]),
            size(r["params_bytes"] + r["opt_state_bytes"]), size(r["sent_bytes"]),
        )  # fmt: skip
    console = _console()
    console.print(table)
    if choice:
        console.print(f"recommended: [bold]{choice['strategy']}[/bold]: {reason}")
    else:
        console.print(f"recommended: none: {reason}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shardplug.core.registry import get_strategy

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise ConfigError("--strategies names no strategy: give e.g. dp,fsdp")
    for name in strategies:
        get_strategy(name)  # an unknown name fails here, before anything compiles
    _prepare(args)
    from shardplug.bench import bench, plot, render

    console = _console()
    quiet = args.json
    report = bench(
        strategies, args.model, args.adapter, args.devices, steps=args.steps,
        rounds=args.rounds, batch_size=args.batch_size, seed=args.seed,
        progress=None if quiet else lambda text: console.print(f"[dim]{text}[/dim]"),
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        render(report, console)
    if args.plot is not None:
        plot(report, str(args.plot))
        if not quiet:
            print(f"shardplug: wrote {args.plot}")
    return 0


COMMANDS = {
    "strategies": cmd_strategies,
    "train": cmd_train,
    "launch": cmd_launch,
    "explain": cmd_explain,
    "recommend": cmd_recommend,
    "bench": cmd_bench,
    "export": cmd_export,
}


def _warn_in_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"shardplug: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also for argparse's own errors)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:
        return int(exit.code or 0)
    with warnings.catch_warnings():
        # shardplug's warnings are reports to the user (a damaged checkpoint, a broken
        # plugin): always one line each, whatever filters the caller has set
        warnings.simplefilter("always", ShardplugWarning)
        warnings.showwarning = _warn_in_one_line
        try:
            return COMMANDS[args.command](args)
        except TrainingInterrupted as exc:
            print(f"shardplug: {exc}", file=sys.stderr)
            return 128 + exc.signal
        except NonFiniteError as exc:
            print(f"shardplug: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except ShardplugError as exc:
            print(f"shardplug: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("shardplug: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
