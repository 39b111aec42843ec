"""``explain``, ``recommend`` and ``bench``: what a strategy costs, before and while it runs."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from shardplug.cli.config import (
    RunConfig,
    check_what,
    plan_batch,
    strategy_of,
    trainer_for,
)
from shardplug.cli.tasks import task_of
from shardplug.errors import ConfigError, ShardplugError


def cmd_explain(args: argparse.Namespace) -> int:
    config = RunConfig.of(args)
    strategy = strategy_of(config)  # an unknown name or option is one line, before anything
    task, devices = _prepare_for(args, config)
    from shardplug.planning.explain import explain
    from shardplug.planning.views import plot, render

    trainer = trainer_for(config, task, strategy, allocate=False, devices=devices)
    batch = plan_batch(task)
    report = explain(trainer, batch, device_memory=args.device_memory, param=args.param)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        render(report, _console(), every_row=args.all)
    if config.plot is not None:
        plot(report, str(config.plot))
        if not args.json:
            print(f"shardplug: wrote {config.plot}")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    config = RunConfig.of(args)
    task, devices = _prepare_for(args, config)
    import jax

    from shardplug.core.compiled.targets import memory_of
    from shardplug.core.devices import select_devices
    from shardplug.core.registry import get_strategy
    from shardplug.planning.explain import backend_memory
    from shardplug.planning.recommend import candidates, recommend

    devices = devices or select_devices(config.devices)
    memory = args.device_memory or memory_of(devices[0]) or backend_memory(devices[0])
    if memory is None:
        raise ConfigError(
            f"--device-memory: the {jax.default_backend().upper()} backend gives no memory "
            "limit; say how much each device has, e.g. --device-memory 80GB"
        )
    strategies = None
    if args.search_seconds != 600.0 and not args.longest_sequence:
        raise ConfigError("--search-seconds bounds --longest-sequence's search: give "
                          "--longest-sequence too, or drop it")  # fmt: skip
    if args.strategies is not None:
        strategies = _named_once([s.strip() for s in args.strategies.split(",") if s.strip()])
        for name in strategies or [""]:
            get_strategy(name)  # an unknown (or no) name fails here, before anything compiles
    from shardplug.core.units import size
    from shardplug.planning.views import render_longest, render_recommend

    title = f"{task.name} ({task.adapter.framework}) on {len(devices)} devices of {size(memory)}"
    if args.target is not None:
        title += f" (compiled for {devices[0].device_kind}, not present)"
    batch = plan_batch(task)  # one batch for every strategy planned

    def planned(name: str, options: Any = None, task: Any = task, batch: Any = batch) -> Any:
        strategy = strategy_of(config, name, options)
        return trainer_for(config, task, strategy, allocate=False, devices=devices), batch

    if args.longest_sequence:
        result = _longest(config, planned, batch, memory, strategies or candidates(),
                          args.search_seconds)  # fmt: skip
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            render_longest(result, _console(), title)
        return 0
    with _candidates_progress() as progress:
        result = recommend(planned, memory, strategies, progress=progress)
    rows = result["strategies"]
    if rows and all("error" in r for r in rows):  # the task's fault, not the devices'
        errors = [r["error"] for r in rows]  # the task's own: the error most of them met
        common = max(errors, key=errors.count)
        plain = next(r for r in rows if r["error"] == common)
        raise ConfigError(f"recommend: every strategy was refused this task ({len(rows)}); "
                          f"{plain['strategy']}: {plain['error']}")  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    render_recommend(result, _console(), title)
    return 0


def _named_once(strategies: list[str]) -> list[str]:
    """``--strategies``, refused where it names one twice."""
    twice = sorted({s for s in strategies if strategies.count(s) > 1})
    if twice:
        raise ConfigError(f"--strategies names {twice[0]} twice: name each once")
    return strategies


def _bench_plan(args: argparse.Namespace, config: RunConfig, strategies: list[str]) -> int:
    """``bench --plan --target GPU``: the strategies' steps and their twins' predicted."""
    if args.plan and (args.steps != 20 or args.rounds != 7):
        raise ConfigError("bench --plan runs nothing, so it takes no --steps or --rounds: "
                          "drop them, or drop --plan to time the steps")  # fmt: skip
    if args.target is None or not args.plan:
        raise ConfigError(
            "bench --plan predicts a GPU's steps from the programs compiled for it, and --target "
            "names the GPU: give both (--plan --target h100), or neither to time the strategies "
            "on this machine"
        )
    task, devices = _prepare_for(args, config)
    from shardplug.planning.bench_plan import plan
    from shardplug.planning.views import render_bench_plan

    console = _console()
    quiet = args.json
    say = None if quiet else lambda text: console.print(f"[dim]{text}[/dim]")
    result = plan(strategies, task, devices, progress=say)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render_bench_plan(result, console)
    return 0


def _prepare_for(args: argparse.Namespace, config: RunConfig) -> tuple[Any, list[Any] | None]:
    """The task, and with ``--target`` the devices of the GPU compiled for on this CPU
    machine (None: this machine's own)."""
    if args.target is None:
        return _prepare(config), None
    from shardplug.core.compiled.targets import find_target, on_cpu_alone, target_devices

    find_target(args.target)  # a typo is one line, before anything
    on_cpu_alone()  # before the task starts JAX's backends
    task = _prepare(config)
    return task, target_devices(args.target, config.devices or 1)


def _longest(config: RunConfig, planned: Callable, batch: Any, memory: int,
             strategies: list[str], seconds: float) -> dict[str, Any]:  # fmt: skip
    """``recommend --longest-sequence``: the longest sequence each strategy fits."""
    from shardplug.planning.longest import longest_sequences

    if config.batch_size is not None:
        raise ConfigError(
            f"--batch-size {config.batch_size}: --longest-sequence plans one sample per "
            "batch-splitting device (the longest a single sample can be): drop --batch-size"
        )
    start = _sequence_of(batch)

    with _candidates_progress() as progress:  # minutes for a pretrained model: said

        def compile_at(name: str, sequence: int, rows: int | None):
            progress(strategies.index(name), len(strategies), f"{name} at {sequence} tokens")
            if sequence == start and rows is None:
                return planned(name)
            other = task_of(config, sequence, rows).task
            return planned(name, task=other, batch=plan_batch(other))

        limit = _positions(config) or 1 << 20
        result = longest_sequences(compile_at, memory, strategies, start, limit=limit,
                                   seconds=seconds)  # fmt: skip
        result["limited_by"] = "the model's positions" if limit < 1 << 20 else "shardplug"
        progress(len(strategies), len(strategies), "")
    refused = [r for r in result["strategies"] if "error" in r]
    if len(refused) == len(result["strategies"]):
        raise ConfigError(
            f"--longest-sequence: every strategy was refused this model ({len(refused)}); "
            f"{refused[0]['strategy']}: {refused[0]['error']}"
        )
    return result


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


def _positions(config: RunConfig) -> int | None:
    """The most positions the model reads (a pretrained checkpoint's
    ``max_position_embeddings``), or None where it has no such bound."""
    if config.init_from is None:
        return None
    from shardplug.pretrained import read_config

    try:
        return read_config(config.init_from).max_positions
    except ShardplugError:  # unreadable here: the task's own load has said why
        return None


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

    config = RunConfig.of(args)
    if args.strategies is None:
        from shardplug.planning.bench import default_strategies

        args.strategies = ",".join(default_strategies())
    strategies = _named_once([s.strip() for s in args.strategies.split(",") if s.strip()])
    if not strategies:
        raise ConfigError("--strategies names no strategy: give e.g. dp,fsdp")
    for name in strategies:
        get_strategy(name)  # an unknown name fails here, before anything compiles
    if args.plan or args.target is not None:
        return _bench_plan(args, config, strategies)
    task = _prepare(config)
    from shardplug.planning.bench import bench
    from shardplug.planning.views import plot_bench, render_bench

    console = _console()
    quiet = args.json
    report = bench(
        strategies, devices=config.devices, steps=args.steps, rounds=args.rounds,
        seed=config.seed or 0, task=task,
        progress=None if quiet else lambda text: console.print(f"[dim]{text}[/dim]"),
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        render_bench(report, console)
    if config.plot is not None:
        plot_bench(report, str(config.plot))
        if not quiet:
            print(f"shardplug: wrote {config.plot}")
    return 0


def _prepare(config: RunConfig) -> Any:
    """Check the flags, give JAX its simulated devices, then load the task (whose file may
    use JAX as it is imported)."""
    from shardplug.core.devices import simulate_cpu_devices

    check_what(config)
    if config.mesh:
        from shardplug.core.mesh import parse_mesh

        parse_mesh(config.mesh)
    simulate_cpu_devices(config.devices)
    return task_of(config).task


def _console():
    import shutil

    from rich.console import Console

    return Console(width=max(100, shutil.get_terminal_size().columns))
