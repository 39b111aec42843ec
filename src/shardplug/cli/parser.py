"""The argument parser of every command: a run's settings' flags from their one declaration
(:mod:`shardplug.cli.settings`), each command's own (its outputs, what it compares) here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, NoReturn

from shardplug.cli.settings import AXIS_TYPES, add_flags
from shardplug.cli.settings import positive as _positive

EXIT_FAILED = 1  # training failed (a non-finite loss)
EXIT_BAD_INPUT = 2
__all__ = ["AXIS_TYPES", "EXIT_BAD_INPUT", "EXIT_FAILED", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line that points to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"shardplug: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, but a flag another command takes is said to be that command's."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            helped = f"{self.prog} {command}" if command else self.prog
            self.exit(EXIT_BAD_INPUT, f"shardplug: error: {_unrecognized(self, command, extras)} "
                      f"(see {helped} --help)\n")  # fmt: skip
        return parsed


def _unrecognized(root: argparse.ArgumentParser, command: str | None, extras: list[str]) -> str:
    """``unrecognized arguments: --target h100``, and where the first flag is another
    command's, which commands take it (``train --target``: explain, recommend and bench)."""
    said = f"unrecognized arguments: {' '.join(extras)}"
    flag = next((e.split("=", 1)[0] for e in extras if e.startswith("--")), None)
    commands = next((a.choices for a in root._actions
                     if isinstance(a, argparse._SubParsersAction)), {})  # fmt: skip
    if flag is None or command not in commands:
        return said
    takers = [name for name, parser in commands.items()
              if name != command and flag in parser._option_string_actions]  # fmt: skip
    if not takers:
        return said
    if len(takers) == 1:
        return f"{said}: {command} takes no {flag}; {takers[0]} takes it"
    return f"{said}: {command} takes no {flag}; {', '.join(takers[:-1])} and {takers[-1]} take it"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def _memory(text: str) -> int:
    """``80GB``, ``512MiB``, ``1.5e9``: a size in bytes."""
    match = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB or 512MiB, got {text!r}")
    try:
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:  # "1.2.3"
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB, got {text!r}") from None
    if not 0 < value < 2**63:  # 1e309 is infinite, and no device holds 8 EiB
        raise argparse.ArgumentTypeError(
            f"expected a positive size below 8 EiB, such as 80GB, got {text!r}"
        )
    return int(value)


def _output(parser: Any, plot: str | None, memory: str | None = None) -> None:
    """A planning command's outputs: ``--json``, and ``--plot`` and ``--device-memory``
    where it takes them."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if plot is not None:
        parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help=plot)
    if memory is not None:
        parser.add_argument("--device-memory", type=_memory, default=None, metavar="SIZE",
                            help=memory)  # fmt: skip


class _Versions(argparse.Action):
    """``--version``: the versions of :func:`shardplug.cli.tools.versions`, one a line."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        from shardplug.cli.tools import aligned, versions

        print(aligned(versions()), end="")
        parser.exit(0)


def _env_command(sub: Any) -> None:
    """``env``: what a bug report names."""
    env = sub.add_parser("env", help="the versions and devices a bug report names")
    env.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _strategies_command(sub: Any) -> None:
    """``strategies``: what is installed, and with ``--all`` what failed to load."""
    strategies = sub.add_parser("strategies", help="list the installed strategies")
    strategies.add_argument("--json", action="store_true", help="print JSON instead of a table")
    strategies.add_argument("--all", action="store_true",
                            help="also add-ons, schedules and plugins that failed to load, "
                            "with hooks and errors")  # fmt: skip


def _train_command(sub: Any) -> None:
    """``train``: what, how, and the loop's flags; ``speed`` leads the groups."""
    train = sub.add_parser(
        "train", help="train a reference model with a strategy",
        description="Train a reference model on simulated or real devices. With no options: "
        "the transformer LM, data parallel, on every GPU (or TPU), or on 8 simulated CPU "
        "devices where there is none.",
    )  # fmt: skip
    add_flags(train, "train")


def _launch_command(sub: Any) -> None:
    """``launch``: the processes and their devices; the train command follows ``--``."""
    launch = sub.add_parser(
        "launch", help="run a command as N processes of one job on this machine",
        description="Start N processes with a coordinator on a free loopback port, each "
        "with its share of the devices, as one jax.distributed job; output prefixed by rank. "
        "Example: shardplug launch --nprocs 2 --devices-per-proc 4 -- train --strategy fsdp",
    )  # fmt: skip
    launch.add_argument("--nprocs", type=_positive(int), required=True, help="processes to start")
    launch.add_argument("--devices-per-proc", type=_positive(int), default=4,
                        help="simulated CPU devices per process (default 4); on a machine with "
                        "NVIDIA GPUs each process gets an equal block of them instead")  # fmt: skip
    launch.add_argument("--restarts", type=_natural, default=0, metavar="N",
                        help="when a worker fails, start every worker again from the newest "
                        "complete checkpoint of the train command's --checkpoint-dir, up to N "
                        "times (default 0: the launch ends, naming it)")  # fmt: skip
    launch.add_argument("--min-nprocs", type=_positive(int), default=None, metavar="K",
                        help="with --restarts: a process that fails twice with no checkpoint "
                        "saved between is taken as lost, and the job goes on without it, down "
                        "to K processes, re-planned as a --resume onto fewer devices; SIGUSR1 "
                        "to the launcher brings them back")  # fmt: skip
    launch.add_argument("--stall-seconds", type=_positive(float), default=None, metavar="S",
                        help="a worker that dispatches no step for S seconds (after its first) "
                        "has stalled: every worker is stopped, and with --restarts starts "
                        "again; longer than the slowest evaluation or checkpoint save "
                        "(default: no limit)")  # fmt: skip
    launch.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- train ...")


def _explain_command(sub: Any) -> None:
    """``explain``: a run's flags, without the loop's, and which parameters to show."""
    explain = sub.add_parser(
        "explain",
        help="what a strategy costs: memory per device, collectives, layout (nothing runs)",
        description="Compile the training step without running it and report each "
        "parameter's layout, the bytes per device (from the compiled step's memory analysis), "
        "the collectives per step next to the textbook figures, and pictures of the layout.",
    )
    add_flags(explain, "explain")
    _output(explain, "PNG picture", "the device's memory, e.g. 80GB, to compare the peak against")
    explain.add_argument("--param", default=None, help="parameter to picture (default: largest)")
    explain.add_argument("--all", action="store_true", help="a row for every parameter "
                         "(default: one per layout and reason, layers as *)")  # fmt: skip
    _target(explain)


def _recommend_command(sub: Any) -> None:
    """``recommend``: a run's flags but ``--strategy``, which it chooses, and what to compare."""
    recommend = sub.add_parser(
        "recommend",
        help="which installed strategies fit in the device's memory, and which to use",
        description="Compile the step with every installed strategy and composition, read its "
        "peak memory per device and its communication per step, and recommend: of those that "
        "fit, one that moves only parameters and gradients, then the fewest bytes sent.",
    )
    add_flags(recommend, "recommend")  # not --strategy: it compares the strategies itself
    _output(recommend, None, "each device's memory, e.g. 80GB or 512MiB (default: what a "
            "GPU's backend gives this process; needed on CPUs)")  # fmt: skip
    recommend.add_argument("--strategies", default=None, metavar="A,B",
                           help="the strategies to compare (default: every installed one and "
                           "composition)")  # fmt: skip
    _target(recommend)
    recommend.add_argument("--longest-sequence", action="store_true",
                           help="instead: the longest sequence each strategy fits, one sample "
                           "per data-parallel device (the task at other lengths: --sequence, "
                           "or its function's sequence=)")  # fmt: skip
    recommend.add_argument("--search-seconds", type=_positive(float), default=600.0,
                           metavar="S", help="with --longest-sequence: stop searching after S "
                           "seconds, over all the strategies (default 600); what fit so far "
                           "is said as 'at least'")  # fmt: skip


def _bench_command(sub: Any) -> None:
    """``bench``: what to train, the strategies to time and how long."""
    bench = sub.add_parser(
        "bench",
        help="time strategies side by side against the same step written by hand in JAX",
        description="Interleaved rounds of every strategy, of the same step written by hand "
        "(jax.jit with the same shardings), of Flax's nnx.jit loop and of one device: compile "
        "time, median step, throughput, peak memory, and the ratio shardplug / hand-written.",
    )
    add_flags(bench, "bench")
    _output(bench, "PNG of the bars")
    bench.add_argument("--strategies", default=None,
                       help="comma-separated strategies or compositions with a hand-written "
                       "twin (default: every one that runs any model with its batch split, "
                       "as its plugin declares: dp, fsdp, 2d and pmap when no other is "
                       "installed)")  # fmt: skip
    bench.add_argument("--steps", type=_positive(int), default=20, help="steps per round")
    bench.add_argument("--rounds", type=_positive(int), default=7, help="interleaved rounds")
    bench.add_argument("--plan", action="store_true",
                       help="run nothing: each strategy and its hand-written twin compiled for "
                       "--target's GPU and their steps predicted from the programs, fastest "
                       "first")  # fmt: skip
    _target(bench)


def _export_command(sub: Any) -> None:
    """``export``: which checkpoint, where to, and in which format."""
    export = sub.add_parser(
        "export", help="write a checkpoint's weights to an .npz for inference",
        description="Write the full parameters and model state of a checkpoint to a NumPy "
        ".npz file (load it with shardplug.load_model).",
    )  # fmt: skip
    export.add_argument("--checkpoint-dir", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True,
                        help="the .npz file to write (with --format hf: a directory)")  # fmt: skip
    export.add_argument("--format", choices=("npz", "hf", "peft"), default="npz",
                        help="npz; hf: config.json and model.safetensors in the pretrained "
                        "family's names and shapes (a run started --init-from; loadable by "
                        "Hugging Face transformers); peft: a --lora run's adapters alone, "
                        "as PEFT writes them")  # fmt: skip
    export.add_argument("--merge", action="store_true",
                        help="with --format hf, for a run that trained --lora adapters: write "
                        "them merged into the base's weights")  # fmt: skip
    export.add_argument("--init-from", default=None, metavar="DIR",
                        help="with --format hf: the checkpoint the run started from (default: "
                        "the one it recorded)")  # fmt: skip
    export.add_argument("--step", type=_positive(int), default=None,
                        help="which checkpoint (default: newest)")  # fmt: skip
    export.add_argument("--task", default=None, metavar="FILE.py:NAME",
                        help="the task the checkpoint trained: load the exported weights back "
                        "into its model")  # fmt: skip


def _plot_command(sub: Any) -> None:
    """``plot``: a metrics file in, a PNG out."""
    plot = sub.add_parser(
        "plot",
        help="draw a run's loss (and held-out loss) against step, from train --metrics-out",
        description="A PNG of the loss, and the held-out loss where the run evaluated, "
        "against the step, from the JSON lines train --metrics-out wrote.",
    )
    plot.add_argument("metrics", type=Path, help="the JSON lines file (train --metrics-out)")
    plot.add_argument("--out", type=Path, default=None,
                      help="the PNG to write (default: beside the metrics, .png)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardplug", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Versions,
                        help="print the versions of shardplug, Python, JAX and the libraries "
                        "it is built on, and exit (shardplug env adds the devices)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _env_command(sub)  # in the order shardplug --help lists them
    _strategies_command(sub)
    _train_command(sub)
    _launch_command(sub)
    _explain_command(sub)
    _recommend_command(sub)
    _bench_command(sub)
    _export_command(sub)
    _plot_command(sub)
    return parser


def _natural(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _target(command: argparse.ArgumentParser) -> None:
    command.add_argument("--target", default=None, metavar="GPU",
                         help="compile for this GPU, not present (h100, h200, a100; --devices "
                         "of them): its compiler's program and memory; needs JAX's CUDA "
                         "plugin, pip install 'shardplug[target]'")  # fmt: skip
