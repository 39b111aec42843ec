"""``explain``, ``recommend`` and ``bench``: what a strategy costs, before and while it runs."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from shardplug.cli._common import (
    _console,
    _plan_batch,
    _planning_trainer,
    _prepare,
    cli_strategy,
    cli_task,
    plot_path,
    task_at,
)
from shardplug.errors import ConfigError


def cmd_explain(args: argparse.Namespace) -> int:
    cli_strategy(args)  # an unknown name or option is one line, before anything else
    args.plot = plot_path(args.plot)
    _prepare(args)
    from shardplug.explain import explain
    from shardplug.views import plot, render

    trainer, batch = _planning_trainer(args, args.strategy, allocate=False)
    report = explain(trainer, batch, device_memory=args.device_memory, param=args.param)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        render(report, _console(), every_row=args.all)
    if args.plot is not None:
        plot(report, str(args.plot))
        if not args.json:
            print(f"shardplug: wrote {args.plot}")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    _prepare(args)
    import jax

    from shardplug.core.devices import select_devices
    from shardplug.core.registry import get_strategy
    from shardplug.explain import backend_memory
    from shardplug.recommend import candidates, longest_sequences, recommend

    devices = select_devices(args.devices)
    if args.device_memory is None:
        args.device_memory = backend_memory(devices[0])
    if args.device_memory is None:
        raise ConfigError(
            f"--device-memory: the {jax.default_backend().upper()} backend gives no memory "
            "limit; say how much each device has, e.g. --device-memory 80GB"
        )
    strategies = None
    if args.strategies is not None:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        for name in strategies or [""]:
            get_strategy(name)  # an unknown (or no) name fails here, before anything compiles
    from shardplug.views import render_longest, render_recommend, size

    title = f"{_title(args)} on {len(devices)} devices of {size(args.device_memory)}"
    if args.longest_sequence:
        if args.batch_size is not None:
            raise ConfigError(
                f"--batch-size {args.batch_size}: --longest-sequence plans one sample per "
                "batch-splitting device (the longest a single sample can be): drop --batch-size"
            )
        start = _sequence_of(_plan_batch(cli_task(args)))

        def compile_at(name: str, sequence: int, rows: int | None):
            task = cli_task(args) if sequence == start and rows is None else \
                task_at(args, sequence, rows)  # fmt: skip
            return _planning_trainer(args, name, allocate=False, task=task)

        result = longest_sequences(
            compile_at, args.device_memory, strategies or candidates(), start
        )
        refused = [r for r in result["strategies"] if "error" in r]
        if len(refused) == len(result["strategies"]):
            first = refused[0]
            raise ConfigError(
                f"--longest-sequence: every strategy was refused this model ({len(refused)}); "
                f"{first['strategy']}: {first['error']}"
            )
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            render_longest(result, _console(), title)
        return 0
    with _candidates_progress() as progress:
        result = recommend(
            lambda name, options=None: _planning_trainer(
                args, name, allocate=False, options=options
            ),
            args.device_memory,
            strategies,
            progress=progress,
        )
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    render_recommend(result, _console(), title)
    return 0


@contextlib.contextmanager
def _candidates_progress() -> Iterator[Callable[[int, int, str], None]]:
    """Progress while candidates compile, on standard error: a bar in a terminal, a line
    per candidate in a pipe or log; then the time it took."""
    import sys
    import time

    began = time.perf_counter()
    bar: list[Any] = []

    def progress(i: int, count: int, name: str) -> None:
        if not sys.stderr.isatty():
            if name:
                print(f"shardplug: compiling {i + 1} of {count}: {name}", file=sys.stderr,
                      flush=True)  # fmt: skip
            return
        if not bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            bar.append(Progress(TextColumn("compiling {task.description}"), BarColumn(),
                                MofNCompleteColumn(), console=Console(stderr=True),
                                transient=True))  # fmt: skip
            bar[0].start()
            bar.append(bar[0].add_task("", total=count))
        bar[0].update(bar[1], completed=i, description=name)

    try:
        yield progress
    finally:
        if bar:
            bar[0].stop()
    print(f"shardplug: compiled the candidates in {time.perf_counter() - began:.0f} s",
          file=sys.stderr, flush=True)  # fmt: skip


def _sequence_of(batch: Any) -> int:
    """The sequence length of the task's batch: the second dimension of its first leaf that
    has one."""
    import jax

    lengths = [leaf.shape[1] for leaf in jax.tree.leaves(batch) if leaf.ndim >= 2]
    if not lengths:
        raise ConfigError(
            "--longest-sequence: the task's batch has no sequence (no leaf of (rows, "
            "sequence, ...)): it plans models that read sequences"
        )
    return lengths[0]


def cmd_bench(args: argparse.Namespace) -> int:
    from shardplug.core.registry import get_strategy

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.plot = plot_path(args.plot)
    if not strategies:
        raise ConfigError("--strategies names no strategy: give e.g. dp,fsdp")
    for name in strategies:
        get_strategy(name)  # an unknown name fails here, before anything compiles
    _prepare(args)
    from shardplug.bench import bench
    from shardplug.views import plot_bench, render_bench

    console = _console()
    quiet = args.json
    report = bench(
        strategies, devices=args.devices, steps=args.steps, rounds=args.rounds, seed=args.seed,
        task=cli_task(args),
        progress=None if quiet else lambda text: console.print(f"[dim]{text}[/dim]"),
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        render_bench(report, console)
    if args.plot is not None:
        plot_bench(report, str(args.plot))
        if not quiet:
            print(f"shardplug: wrote {args.plot}")
    return 0


def _title(args: argparse.Namespace) -> str:
    task = cli_task(args)
    return f"{task.name} ({task.adapter.framework})"
