"""The argument parser of every command: each flag defined once, here, in the group of the
commands that take it (what to train, how, the training loop's, each command's own)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any, NoReturn

EXIT_FAILED = 1  # training failed (a non-finite loss)
EXIT_BAD_INPUT = 2
AXIS_TYPES = ("auto", "explicit")  # core.mesh.AXIS_TYPES, without importing JAX here


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line that points to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"shardplug: error: {message} (see {self.prog} --help)\n")


def _probability(text: str) -> float:
    """A probability in [0, 1): a dropout's."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text}")
    return value


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


def _step_range(text: str) -> range:
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B, got {text!r}")
    return range(start, stop)


def _what(parser: Any) -> None:
    """What to train: ``--task``, ``--init-from`` or a reference ``--model`` and its shape."""
    add = parser.add_argument
    add("--task", default=None, metavar="FILE.py:NAME",
        help="your task: a shardplug.Task (or a function returning one) in a file or a module "
        "(package.module:NAME), instead of a reference --model")  # fmt: skip
    add("--model", default=None,
        help="reference model: mlp, classifier, transformer or cnn (default: "
        "transformer)")  # fmt: skip
    add("--adapter", default=None, help="the reference model's framework: nnx, linen or equinox")
    add("--init-from", default=None, metavar="DIR",
        help="start from a pretrained checkpoint in Hugging Face's format (config.json and "
        "safetensors: Llama, Mistral, Qwen2/3, Gemma 3, Mixtral, Phi-3), read straight into the "
        "strategy's layout, instead of a reference --model")  # fmt: skip
    add("--param-dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="with --init-from: the parameters' dtype (default: as the checkpoint stores "
        "them)")  # fmt: skip
    add("--data", default=None, metavar="text:FILE_OR_GLOB",
        help="with --init-from: fine-tune on your text (a .jsonl file's lines or any other "
        "file each one document), tokenized by the checkpoint's tokenizer and packed into "
        "rows of --sequence tokens")  # fmt: skip
    add("--tokenizer", default=None, metavar="DIR",
        help="with --data text:...: the directory of the tokenizer.json to use (default: the "
        "--init-from checkpoint's)")  # fmt: skip
    add("--layers", type=_positive(int), default=None, metavar="N",
        help="the transformer's depth, as one layer stack (default 2)")  # fmt: skip
    add("--remat", choices=("none", "dots", "full", "offload"), default=None,
        help="what each transformer block recomputes in the backward pass; offload "
        "recomputes all of it from the block's input, kept in host memory (default "
        "none)")  # fmt: skip
    add("--experts", type=_positive(int), default=None, metavar="E",
        help="make each transformer MLP a routed mixture of E experts")  # fmt: skip
    add("--top-k", type=_positive(int), default=None, metavar="K",
        help="the experts each token runs (default 2)")  # fmt: skip
    add("--capacity-factor", type=_positive(float), default=None, metavar="F",
        help="each expert takes at most F x its even share of the tokens; the rest are "
        "dropped (default: none dropped)")  # fmt: skip
    add("--capacity-groups", type=_positive(int), default=None, metavar="G",
        help="count capacity in G equal groups of consecutive tokens (GShard); G = the "
        "batch's devices keeps ep's all-to-alls at F x the tokens' bytes (default 1: the "
        "whole batch)")  # fmt: skip
    add("--bias-rate", type=_positive(float), default=None, metavar="U",
        help="auxiliary-loss-free balancing (DeepSeek-V3): each step every expert's routing "
        "bias moves by U toward an even load (e.g. 0.001)")  # fmt: skip
    add("--sequence", type=_positive(int), default=None, metavar="N",
        help="the sequence length: the reference transformer's (default 32), or a --task "
        "function's that takes a sequence")  # fmt: skip
    add("--batch-size", type=_positive(int), default=None,
        help="global batch size (a --task function's, if it takes batch_size)")  # fmt: skip
    add("--seed", type=seed, default=None, help="(default 0, or the checkpoint's)")
    add("--devices", type=_positive(int), default=None,
        help="devices to use (default: every GPU or TPU; without one, 8 simulated CPU "
        "devices)")  # fmt: skip


def _how(parser: Any, speed: Any, strategy: bool = True) -> None:
    """How to train it: the strategy and its options (unless the command compares
    strategies of its own), add-ons, the mesh, the step's microbatches and precision (the
    latter two in the ``speed`` group)."""
    add = parser.add_argument
    if strategy:
        add("--strategy", default="dp",
            help="a strategy or parallelisms joined by '+', e.g. fsdp+tp (default: "
            "dp)")  # fmt: skip
        add("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
            help="a strategy option, e.g. -o min_size=0 for fsdp (repeatable)")  # fmt: skip
    add("--addon", action="append", default=[], metavar="NAME",
        help="an add-on plugin that wraps the strategy's hooks (repeatable)")  # fmt: skip
    add("--mesh", default=None,
        help="axis sizes, e.g. data=2,model=4 (a composition sizes the axes left out)")  # fmt: skip
    add("--axis-name", action="append", default=[], metavar="ROLE=NAME",
        help="name a composition's mesh axis as your model does, e.g. model=tp "
        "(repeatable)")  # fmt: skip
    add("--axis-types", choices=AXIS_TYPES, default=None,
        help="the mesh's axis types: explicit for a model that reshards or gives its einsums "
        "out_sharding (default: chosen for the model; explain says which and why)")  # fmt: skip
    speed.add_argument(
        "--grad-accum", type=_positive(int), default=1, metavar="K",
        help="microbatches per step, inside the compiled step: the update of the whole batch "
        "with the activation memory of 1/K of it (default 1)",
    )  # fmt: skip
    speed.add_argument(
        "--precision", choices=("auto", "float32", "bf16"), default="auto",
        help="bf16: bfloat16 forward and backward, float32 parameters and optimizer state; "
        "auto (the default): bf16 where the devices have bfloat16 matrix units (TPU, NVIDIA "
        "A100 and later), float32 elsewhere (CPU)",
    )  # fmt: skip


def _optimizer(parser: Any) -> None:
    """The optimizer's flags (a reference model's or a pretrained checkpoint's run; a task
    brings its own): see :class:`shardplug.optim.Optimizer`."""
    group = parser.add_argument_group("optimizer (a --task brings its own)")
    add = group.add_argument
    add("--optimizer", choices=("adam", "adamw", "sgd"), default=None,
        help="default: adam for a reference model, adamw for --init-from")  # fmt: skip
    add("--lr", type=_positive(float), default=None,
        help="the peak learning rate (default: the model's; 1e-4 for --init-from)")  # fmt: skip
    add("--weight-decay", type=float, default=None, metavar="W",
        help="adamw's decoupled weight decay, on every parameter (default 1e-4)")  # fmt: skip
    add("--momentum", type=float, default=None, metavar="M", help="sgd's momentum (default none)")
    add("--schedule", choices=("constant", "cosine", "linear", "wsd"), default=None,
        help="after --warmup, the learning rate stays, falls along a cosine or a line to "
        "--end-lr at --decay-steps, or stays and falls over the last 20%% of them "
        "(warmup-stable-decay) (default constant)")  # fmt: skip
    add("--warmup", type=int, default=None, metavar="STEPS",
        help="steps of linear warmup from 0 (default 0)")  # fmt: skip
    add("--decay-steps", type=_positive(int), default=None, metavar="STEPS",
        help="where a decaying --schedule ends (default --steps)")  # fmt: skip
    add("--end-lr", type=float, default=None, metavar="LR",
        help="where a decaying --schedule ends (default 0)")  # fmt: skip
    add("--clip-norm", type=float, default=None, metavar="C",
        help="clip each step's gradient to this global norm")  # fmt: skip


def _lora(parser: Any) -> None:
    """Low-rank adapters on the frozen model (:mod:`shardplug.lora`)."""
    group = parser.add_argument_group("adapters (LoRA)")
    add = group.add_argument
    add("--lora", type=_positive(int), default=None, metavar="RANK",
        help="train low-rank adapters of this rank on the frozen model, not the model "
        "itself")  # fmt: skip
    add("--lora-alpha", type=_positive(float), default=None, metavar="A",
        help="the adapters' scale is A / RANK (default A = RANK)")  # fmt: skip
    add("--lora-dropout", type=_probability, default=None, metavar="P",
        help="in training, drop each adapter's input with probability P (PEFT's "
        "lora_dropout; default 0, or --lora-from's)")  # fmt: skip
    add("--lora-from", default=None, metavar="DIR",
        help="with --init-from: start from PEFT's adapters in DIR (adapter_config.json, "
        "adapter_model.safetensors), their rank, alpha and targets")  # fmt: skip
    add("--lora-quantize", default=None, choices=("int8", "int4", "nf4"),
        help="QLoRA: keep the frozen weights the adapters train on quantized by Qwix, 8-bit "
        "or 4-bit (int4, or nf4: QLoRA's NormalFloat), dequantized a layer at a time in the "
        "forward pass")  # fmt: skip
    add("--lora-targets", default=None, metavar="REGEX",
        help="the weights with adapters: a pattern searched in each parameter's path "
        "(default: every matrix but embeddings, positions, the output head and norms)")  # fmt: skip


def _train(parser: Any, speed: Any) -> None:
    """The training loop's flags: its length, outputs, profile, checkpoints, processes."""
    add = parser.add_argument
    add("--steps", type=_positive(int), default=100,
        help="train to this step; with --resume, counting the steps already taken "
        "(default 100)")  # fmt: skip
    add("--log-every", type=_positive(int), default=10)
    add("--skip-memory-check", action="store_true",
        help="start even when the compiled step's peak is more than the devices (or, for "
        "simulated CPU devices, the host) have")  # fmt: skip
    add("--data-timeout", type=_positive(float), default=None, metavar="SECONDS",
        help="give up when the data produces no batch for this long (default: wait, saying "
        "so after 30 s)")  # fmt: skip
    add("--plot", type=Path, default=None, metavar="FILE.png",
        help="at the end, a PNG of the loss (and held-out loss) against step")  # fmt: skip
    add("--metrics-out", type=Path, default=None,
        help="JSON lines, one per step (appended to with --resume)")  # fmt: skip
    add("--tensorboard", type=Path, default=None, metavar="DIR",
        help="also write the rows as TensorBoard event files into DIR")  # fmt: skip
    add("--eval-every", type=_positive(int), default=None, metavar="K",
        help="evaluate on the task's held-out data every K steps (rows get eval_*)")  # fmt: skip
    add("--peak-tflops", type=_positive(float), default=None, metavar="X",
        help="each device's peak TFLOP/s, for MFU where the device is not a known one")  # fmt: skip
    add("--quiet", action="store_true", help="no progress bar")
    speed.add_argument("--profile", type=Path, default=None, metavar="DIR",
                       help="write a profiler trace of --profile-steps here (TensorBoard, "
                       "Perfetto)")  # fmt: skip
    speed.add_argument("--profile-steps", type=_step_range, default=range(3, 6), metavar="A:B",
                       help="the steps to trace, from A to B-1 (default 3:6)")  # fmt: skip
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", type=Path, default=None,
                      help="save checkpoints here (asynchronously, each device its own "
                      "shards); SIGINT/SIGTERM then save and stop")  # fmt: skip
    ckpt.add_argument("--checkpoint-every", type=_positive(int), default=None,
                      help="steps between checkpoints (default: only at the end)")  # fmt: skip
    ckpt.add_argument("--keep", type=_positive(int), default=None,
                      help="checkpoints to keep (default 3)")  # fmt: skip
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest good checkpoint in --checkpoint-dir, with "
                      "the checkpoint's model, adapter, seed and batch size unless given; the "
                      "strategy, devices and mesh may differ")  # fmt: skip
    ckpt.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                      help="a NaN/inf loss: stop with the step and last good checkpoint named "
                      "(default), or skip the update and count it")  # fmt: skip
    multi = parser.add_argument_group(
        "multi-process (jax.distributed)",
        "Join a job of many processes, one global mesh: give all three, or --distributed to "
        "read them from the cluster's environment (SLURM, Open MPI, Cloud TPU). --devices is "
        "then the job's total; each process feeds its own rows of every batch.",
    )
    multi.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's address")  # fmt: skip
    multi.add_argument("--num-processes", type=_positive(int), default=None)
    multi.add_argument("--process-id", type=int, default=None)
    multi.add_argument("--distributed", action="store_true",
                       help="join the job the environment describes "
                       "(jax.distributed.initialize())")  # fmt: skip


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
    """``train``: what, how, and the loop's flags; ``speed`` made first leads the groups."""
    train = sub.add_parser(
        "train", help="train a reference model with a strategy",
        description="Train a reference model on simulated or real devices. With no options: "
        "the transformer LM, data parallel, on every GPU (or TPU), or on 8 simulated CPU "
        "devices where there is none.",
    )  # fmt: skip
    speed = train.add_argument_group("speed")
    _what(train)
    _optimizer(train)
    _lora(train)
    _how(train, speed)
    _train(train, speed)


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
    _what(explain)
    _optimizer(explain)
    _lora(explain)
    _how(explain, explain)
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
    _what(recommend)
    _optimizer(recommend)
    _lora(recommend)
    _how(recommend, recommend, strategy=False)  # it compares the strategies itself
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


def _bench_command(sub: Any) -> None:
    """``bench``: what to train, the strategies to time and how long."""
    bench = sub.add_parser(
        "bench",
        help="time strategies side by side against the same step written by hand in JAX",
        description="Interleaved rounds of every strategy, of the same step written by hand "
        "(jax.jit with the same shardings), of Flax's nnx.jit loop and of one device: compile "
        "time, median step, throughput, peak memory, and the ratio shardplug / hand-written.",
    )
    _what(bench)
    _optimizer(bench)
    _lora(bench)
    _output(bench, "PNG of the bars")
    bench.add_argument("--strategies", default="dp,fsdp,2d,pmap",
                       help="comma-separated strategies or compositions with a hand-written "
                       "twin (default: dp,fsdp,2d,pmap)")  # fmt: skip
    bench.add_argument("--steps", type=_positive(int), default=20, help="steps per round")
    bench.add_argument("--rounds", type=_positive(int), default=7, help="interleaved rounds")


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


def _target(command: argparse.ArgumentParser) -> None:
    command.add_argument("--target", default=None, metavar="GPU",
                         help="compile for this GPU, not present (h100, h200, a100; --devices "
                         "of them): its compiler's program and memory; needs JAX's CUDA "
                         "plugin, pip install 'shardplug[target]'")  # fmt: skip
