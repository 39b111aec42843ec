"""What the commands share: argument types, strategy options, the reference trainer."""

from __future__ import annotations

import argparse
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from shardplug.errors import ConfigError, MeshError, StrategyOptionError

EXIT_FAILED = 1  # training failed (a non-finite loss)


EXIT_BAD_INPUT = 2
AXIS_TYPES = ("auto", "explicit")  # core.mesh.AXIS_TYPES, without importing JAX here
AXIS_TYPES_HELP = (
    "the mesh's axis types: explicit for a model that reshards or gives its einsums "
    "out_sharding (default: chosen for the model; explain says which and why)"
)


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
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def seed(text: str) -> int:
    """A seed for ``jax.random.key`` and NumPy: a whole number from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be from 0 to 4294967295, got {text}")
    return value


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
    task_arguments(parser)
    model_options_arguments(parser)
    parser.add_argument(
        "--devices", type=_positive(int), default=None,
        help="devices to use (default: every GPU or TPU; without one, 8 simulated CPU devices)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=_positive(int), default=None, help="global batch")
    parser.add_argument("--seed", type=seed, default=0)
    if trainer_options:
        parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                            help="a strategy option (repeatable)")  # fmt: skip
        parser.add_argument("--addon", action="append", default=[], metavar="NAME")
        parser.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,model=4")
        parser.add_argument("--axis-name", action="append", default=[], metavar="ROLE=NAME",
                            help="name a composition's mesh axis as your model does, "
                            "e.g. model=tp (repeatable)")  # fmt: skip
        parser.add_argument("--axis-types", choices=AXIS_TYPES, default=None,
                            help=AXIS_TYPES_HELP)  # fmt: skip
        parser.add_argument("--grad-accum", type=_positive(int), default=1, metavar="K")
        parser.add_argument("--precision", choices=("auto", "float32", "bf16"), default="auto",
                            help="default auto: bf16 where the devices have bfloat16 matrix "
                            "units, float32 elsewhere")  # fmt: skip


def task_arguments(parser: Any) -> None:
    """``--task``, or ``--model`` and ``--adapter``: what to train."""
    parser.add_argument(
        "--task", default=None, metavar="FILE.py:NAME",
        help="your task: a shardplug.Task (or a function returning one) in a file or a module "
        "(package.module:NAME), instead of a reference --model",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=None,
        help="reference model: mlp, classifier, transformer or cnn (default: transformer)",
    )  # fmt: skip
    parser.add_argument(
        "--adapter", default=None, help="the reference model's framework: nnx, linen or equinox"
    )
    parser.add_argument(
        "--init-from", default=None, metavar="DIR",
        help="start from a pretrained checkpoint in Hugging Face's format (config.json and "
        "safetensors: Llama, Mistral, Qwen2/3, Gemma 3, Mixtral), read straight into the "
        "strategy's layout, instead of a reference --model",
    )  # fmt: skip
    parser.add_argument(
        "--param-dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="with --init-from: the parameters' dtype (default: as the checkpoint stores them)",
    )  # fmt: skip
    parser.add_argument(
        "--data", default=None, metavar="text:FILE_OR_GLOB",
        help="with --init-from: fine-tune on your text (a .jsonl file's lines or any other "
        "file each one document), tokenized by the checkpoint's tokenizer and packed into "
        "rows of --sequence tokens",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="with --data text:...: the directory of the tokenizer.json to use (default: the "
        "--init-from checkpoint's)",
    )  # fmt: skip


MODEL_ONLY = ("model", "adapter", "layers", "remat", "lr", "experts", "top_k", "capacity_factor",
              "capacity_groups", "bias_rate")  # fmt: skip
SIZES = ("sequence", "batch_size")  # the reference model's, or a task function's that takes them


PRETRAINED_TAKES = ("adapter", "remat", "lr")  # a pretrained model's options from the CLI


def check_task_flags(args: argparse.Namespace) -> None:
    """A task brings its own model, data and optimizer: refuse the reference model's flags;
    a pretrained checkpoint its own shape: refuse those that would change it."""
    init_from = getattr(args, "init_from", None)
    data, tokenizer = getattr(args, "data", None), getattr(args, "tokenizer", None)
    if data is not None and not data.startswith("text:"):
        raise ConfigError(f"--data {data}: give text:FILE_OR_GLOB (a file, directory or glob)")
    if tokenizer is not None and data is None:
        raise ConfigError("--tokenizer tokenizes --data text:...: give the text too")
    if data is not None and init_from is None:
        raise ConfigError(
            "--data text:... fine-tunes a pretrained checkpoint on your text: give "
            "--init-from DIR (a --task brings its own data)"
        )
    if init_from is not None:
        if getattr(args, "task", None) is not None:
            raise ConfigError("--init-from and --task both say what to train: give one")
        shape = [f"--{k.replace('_', '-')}" for k in MODEL_ONLY
                 if k not in PRETRAINED_TAKES and getattr(args, k, None) is not None]  # fmt: skip
        if shape:
            raise ConfigError(
                f"{', '.join(shape)} shape the reference model; --init-from {init_from} "
                f"takes its shape from the checkpoint's config.json: drop "
                f"{'them' if len(shape) > 1 else 'it'}"
            )
        return
    if getattr(args, "param_dtype", None) is not None:
        raise ConfigError("--param-dtype casts a checkpoint's parameters: give --init-from DIR")
    if getattr(args, "task", None) is None:
        return
    given = [f"--{k.replace('_', '-')}" for k in MODEL_ONLY if getattr(args, k, None) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} set the reference model; --task {args.task} brings its own "
            f"model, optimizer and data: drop {'them' if len(given) > 1 else 'it'}"
        )


def cli_task(args: argparse.Namespace) -> Any:
    """The :class:`shardplug.Task` the command line names (loaded once per command): the
    ``--task``, or the reference ``--model`` as a task."""
    if getattr(args, "_task", None) is None:
        if args.task is not None:
            from shardplug.task import load_task

            args._task = load_task(args.task, **task_sizes(args))
        elif getattr(args, "init_from", None) is not None:
            from shardplug import pretrained

            args._pretrained = pretrained.load(args.init_from, dtype=args.param_dtype)
            args._task = args._pretrained.task(
                args.adapter or "nnx", batch_size=args.batch_size, seed=args.seed,
                sequence=args.sequence, learning_rate=getattr(args, "lr", None),
                remat=getattr(args, "remat", None) or "none",
                text=args.data.removeprefix("text:") if args.data else None,
                tokenizer=args.tokenizer,
            )  # fmt: skip
        else:
            from shardplug.models import get_model

            args._task = get_model(args.model or "transformer").task(
                args.adapter or "nnx", batch_size=args.batch_size, seed=args.seed,
                learning_rate=getattr(args, "lr", None), **model_options(args),
            )  # fmt: skip
    return args._task


def task_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """``--sequence`` and ``--batch-size`` as given, for a task function that takes them."""
    return {k: getattr(args, k) for k in SIZES if getattr(args, k, None) is not None}


def read_first(data: Any, limit_s: float | None = None) -> Any:
    """The first batch of ``data`` (None if it has none), the wait announced and bounded;
    a :class:`shardplug.data.Batches`'s read alone, with no read-ahead beside it."""
    from shardplug.data import Batches
    from shardplug.loop.waits import DataWait

    with DataWait(limit_s) as wait, wait.on("the first batch"):
        return data.first() if isinstance(data, Batches) else next(iter(data), None)


def first_batch(task: Any, limit_s: float | None = None) -> Any:
    """The task's first batch, to compile for; None when its data can be read only once
    (an iterator, which ``fit`` then compiles for on its own first batch)."""
    data = task.batches()  # a function's data is made afresh each time
    if iter(data) is data and not callable(task.data):
        return None
    return read_first(data, limit_s)


def model_options_arguments(parser: Any) -> None:
    """``--layers`` and ``--remat``: the reference transformer's depth and rematerialisation."""
    parser.add_argument(
        "--layers",
        type=_positive(int),
        default=None,
        metavar="N",
        help="the transformer's depth, as one layer stack (default 2)",
    )
    parser.add_argument("--remat", choices=("none", "dots", "full"), default=None,
                        help="what each transformer block recomputes in the backward pass "
                        "(default none)")  # fmt: skip
    parser.add_argument("--experts", type=_positive(int), default=None, metavar="E",
                        help="make each transformer MLP a routed mixture of E experts")  # fmt: skip
    parser.add_argument("--top-k", type=_positive(int), default=None, metavar="K",
                        help="the experts each token runs (default 2)")  # fmt: skip
    parser.add_argument("--capacity-factor", type=_positive(float), default=None, metavar="F",
                        help="each expert takes at most F x its even share of the tokens; "
                        "the rest are dropped (default: none dropped)")  # fmt: skip
    parser.add_argument("--capacity-groups", type=_positive(int), default=None, metavar="G",
                        help="count capacity in G equal groups of consecutive tokens (GShard); "
                        "G = the batch's devices keeps ep's all-to-alls at F x the tokens' "
                        "bytes (default 1: the whole batch)")  # fmt: skip
    parser.add_argument("--bias-rate", type=_positive(float), default=None, metavar="U",
                        help="auxiliary-loss-free balancing (DeepSeek-V3): each step every "
                        "expert's routing bias moves by U toward an even load (e.g. "
                        "0.001)")  # fmt: skip
    parser.add_argument("--sequence", type=_positive(int), default=None, metavar="N",
                        help="the sequence length: the reference transformer's (default 32), "
                        "or a --task function's that takes a sequence")  # fmt: skip


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The reference model's options the command line gave (``layers``, ``remat``, the
    experts'...): read once, the one path every command takes to them (checked, stored in
    the checkpoint's config, given to the model)."""
    if getattr(args, "_model_options", None) is None:
        from shardplug.models import TRANSFORMER_OPTIONS

        given = {k: getattr(args, k, None) for k in TRANSFORMER_OPTIONS}
        args._model_options = {k: v for k, v in given.items() if v}
    return args._model_options


def _step_range(text: str) -> range:
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B, got {text!r}")
    return range(start, stop)


def parse_options(strategy: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``["min_size=0"]`` into ``{"min_size": 0}``, typed by the strategy's own signature
    (:meth:`shardplug.StrategyOption.parse`)."""
    from shardplug.core.registry import strategy_options

    known = {o.name: o for o in strategy_options(strategy)}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise StrategyOptionError(f"strategy option {pair!r} is not KEY=VALUE")
        if key not in known and key.partition(".")[::2] in {(strategy, o) for o in known}:
            key = key.partition(".")[2]  # -o pp.schedule=zb for pp alone, as in a composition
        if key not in known:
            takes = ", ".join(sorted(known)) or "none"
            raise StrategyOptionError(
                f"strategy {strategy!r} has no option {key!r}; its options: {takes}"
            )
        options[key] = known[key].parse(text)
    return options


def cli_strategy(args: argparse.Namespace, name: str | None = None,
                 options: dict[str, Any] | None = None) -> Any:  # fmt: skip
    r"""The one path from the command line to a :class:`~shardplug.core.registry.Strategy`:
    ``name`` (``--strategy`` by default, its ``-o`` options with it; another name, as a
    candidate, without them), its ``--addon``\s and ``--axis-name``\s. Made once for
    ``--strategy`` (an unknown name or option is one line, before JAX starts)."""
    from shardplug.core.registry import get_strategy

    if options or (name is not None and name != getattr(args, "strategy", None)):
        return get_strategy(name or args.strategy, addons=args.addon,
                            axis_names=axis_names(args.axis_name), **(options or {}))  # fmt: skip
    if getattr(args, "_strategy", None) is None:
        options = parse_options(args.strategy, getattr(args, "option", []))
        args._strategy = get_strategy(
            args.strategy, addons=args.addon, axis_names=axis_names(args.axis_name), **options
        )
    return args._strategy


def axis_names(pairs: Sequence[str]) -> dict[str, str]:
    """``["model=tp"]`` into ``{"model": "tp"}``."""
    names: dict[str, str] = {}
    for pair in pairs:
        role, sep, name = (part.strip() for part in pair.partition("="))
        if not sep or not role.isidentifier() or not name.isidentifier():
            raise MeshError(f"--axis-name {pair!r} is not ROLE=NAME, e.g. model=tp")
        names[role] = name
    return names


def _planning_trainer(
    args: argparse.Namespace,
    strategy: str,
    allocate: bool = True,
    task: Any = None,
    options: dict[str, Any] | None = None,
):
    """A trainer of the task with ``strategy`` (:func:`cli_strategy`; planning only, for
    ``allocate=False``); and the batch to compile its step for. ``task``: another size of
    the command line's task (:func:`task_at`), planned on its own first batch."""
    own = task is None
    task = cli_task(args) if own else task
    trainer = task.trainer(
        allocate=allocate,
        strategy=cli_strategy(args, strategy, options),
        devices=args.devices,
        mesh=args.mesh,
        seed=args.seed,
        grad_accum=args.grad_accum,
        precision=args.precision,
        axis_types=args.axis_types,
    )
    if not own:
        return trainer, _plan_batch(task)
    if getattr(args, "_plan_batch", None) is None:  # one batch for every strategy planned
        args._plan_batch = _plan_batch(task)
    return trainer, args._plan_batch


def _plan_batch(task: Any) -> Any:
    batch = read_first(task.batches())  # planning trains on nothing
    if batch is None:
        raise ConfigError(f"task {task.name}: its data gave no batch to plan for")
    return batch


def task_at(args: argparse.Namespace, sequence: int, batch_size: int | None) -> Any:
    """The command line's task at another ``sequence`` (and global ``batch_size``, None for
    its own): the reference model's, or a task function's that takes them."""
    sizes = {"sequence": sequence, "batch_size": batch_size or getattr(args, "batch_size", None)}
    if args.task is not None:
        from shardplug.task import load_task

        return load_task(args.task, **sizes)
    from shardplug.models import get_model

    options = {**model_options(args), **{k: v for k, v in sizes.items() if v is not None}}
    return get_model(args.model or "transformer").task(
        args.adapter or "nnx", seed=args.seed, learning_rate=getattr(args, "lr", None), **options
    )


def _prepare(args: argparse.Namespace) -> None:
    """Check the flags, give JAX its simulated devices, then load the task (whose file may
    use JAX as it is imported)."""
    from shardplug.core.devices import simulate_cpu_devices
    from shardplug.models import check_adapter, get_model

    check_task_flags(args)
    if args.task is None:
        get_model(args.model or "transformer").check_options(**model_options(args))
        check_adapter(args.adapter or "nnx")
    if getattr(args, "mesh", None):
        from shardplug.core.mesh import parse_mesh

        parse_mesh(args.mesh)
    simulate_cpu_devices(args.devices)
    cli_task(args)


def _console():
    from rich.console import Console

    return Console(width=max(100, shutil.get_terminal_size().columns))


def _quiet_orbax() -> None:
    """Orbax reports routine events as absl warnings; the command line prints its own."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def plot_path(path: Path | None) -> Path | None:
    """Where ``--plot`` draws: refused at once when it names a folder; ``.png`` added when
    it has no suffix (as matplotlib would); its missing folders made."""
    if path is None:
        return None
    if path.is_dir():
        raise ConfigError(f"--plot {path} is a folder: name the .png file to write in it")
    path = path if path.suffix else path.with_suffix(".png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot make its folder ({e.strerror})") from None
    return path
