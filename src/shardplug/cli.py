"""The ``shardplug`` command line: list strategies, train with one chosen by name.

Every bad input ends in one line on stderr, ``shardplug: error: ...``, and exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from shardplug.errors import ConfigError, ShardplugError, StrategyOptionError

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
    train.add_argument("--model", default="transformer", help="mlp, classifier, transformer or cnn")
    train.add_argument(
        "--adapter", default="nnx", help="model framework: nnx, linen or equinox (default: nnx)"
    )
    train.add_argument("--steps", type=_positive(int), default=100)
    train.add_argument("--batch-size", type=_positive(int), default=None, help="global batch size")
    train.add_argument(
        "--devices",
        type=_positive(int),
        default=8,
        help="devices to use; without an accelerator, simulated CPU devices (default 8)",
    )
    train.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,model=4")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--lr", type=_positive(float), default=None, help="Adam learning rate")
    train.add_argument("--log-every", type=_positive(int), default=10)
    train.add_argument("--metrics-out", type=Path, default=None, help="JSON lines, one per step")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
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


def cmd_train(args: argparse.Namespace) -> int:
    # Validate everything the user typed before JAX starts, so a typo costs nothing.
    from shardplug.core.devices import simulate_cpu_devices
    from shardplug.core.mesh import parse_mesh
    from shardplug.models import check_adapter, get_model

    model = get_model(args.model)
    check_adapter(args.adapter)
    options = parse_options(args.strategy, args.option)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.metrics_out is not None and args.metrics_out.is_dir():
        raise ConfigError(f"--metrics-out {args.metrics_out} is a directory: name a file")
    simulate_cpu_devices(args.devices)

    import optax

    from shardplug.core.mesh import describe
    from shardplug.core.registry import get_strategy
    from shardplug.core.trainer import Trainer

    trainer = Trainer(
        model.adapter(args.adapter),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(args.lr or model.learning_rate),
        strategy=get_strategy(args.strategy, addons=args.addon, **options),
        devices=args.devices,
        mesh=mesh,
        seed=args.seed,
        log_every=args.log_every,
    )
    batch_size = args.batch_size or model.batch_size
    batches = model.batches(batch_size, args.seed)
    first = next(batches)
    trainer.compile(first)  # a batch that does not split fails here, before any output
    out = _open_metrics(args.metrics_out)
    try:
        with _Progress(args.quiet, args.steps) as advance:

            def log(rows: list[dict[str, float]]) -> None:
                if out is not None:
                    out.writelines(json.dumps(row) + "\n" for row in rows)
                    out.flush()
                advance(rows)

            history = trainer.fit(itertools.chain([first], batches), steps=args.steps, callback=log)
    finally:
        if out is not None:
            out.close()
    device = trainer.mesh.devices.flat[0].platform
    timed = history[min(args.log_every, len(history) - 1) :] or history
    step_ms = 1000 * sum(r["step_time"] for r in timed) / len(timed)
    print(
        f"shardplug: trained {args.model} ({args.adapter}) with {args.strategy} on "
        f"{trainer.mesh.size} {device} devices ({describe(trainer.mesh)}), "
        f"batch {batch_size}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"in {len(history)} steps; compile {trainer.compile_seconds:.1f} s, "
        f"{step_ms:.1f} ms/step, {batch_size / step_ms * 1000:.0f} samples/s"
    )
    return 0


def _open_metrics(path: Path | None) -> Any:
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("w")
    except OSError as exc:
        raise ConfigError(f"cannot write --metrics-out {path}: {exc.strerror}") from None


class _Progress:
    """A rich progress bar on stderr advanced by history rows, or nothing with --quiet."""

    def __init__(self, quiet: bool, total: int):
        self.quiet, self.total = quiet, total

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
        task = self.bar.add_task("training", total=self.total, loss="-")

        def advance(rows):
            self.bar.update(task, advance=len(rows), loss=f"{rows[-1]['loss']:.4f}")

        return advance

    def __exit__(self, *exc):
        if not self.quiet:
            self.bar.stop()


COMMANDS = {"strategies": cmd_strategies, "train": cmd_train}


def _warn_in_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"shardplug: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also for argparse's own errors)."""
    warnings.showwarning = _warn_in_one_line
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:
        return int(exit.code or 0)
    try:
        return COMMANDS[args.command](args)
    except ShardplugError as exc:
        print(f"shardplug: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("shardplug: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
