"""Every setting of a run, declared once: :class:`RunConfig`'s fields. Each field's
:func:`setting` is its flag, help, type and check (argparse's), default, the commands that
take it (its ``part``), the ``--help`` section it is listed in, what a resume does with it
(its ``tags``), and whether it reaches the :class:`~shardplug.Trainer` (``trainer``: a
keyword of the same name, :class:`~shardplug.settings.Settings`'s). The parser adds the
flags from here (:func:`shardplug.cli.parser.build_parser`), the resume rules read the tags
(:data:`KNOBS`, :data:`RESUMED`, ...) and ``trainer_for`` hands the Trainer its keywords.

A new flag that reaches the Trainer: its field in ``shardplug.settings.Settings`` (type,
check, default, documentation) and its :func:`setting` here, ``trainer=True``."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

#: the commands that take each part's flags (bench times steps of its own)
PARTS = {
    "train": ("what", "optimizer", "lora", "strategy", "how", "train"),
    "explain": ("what", "optimizer", "lora", "strategy", "how"),
    "recommend": ("what", "optimizer", "lora", "how"),
    "bench": ("what", "optimizer", "lora"),
}
#: the --help sections (argparse's groups) and their descriptions, in the order listed
SECTIONS = {
    "speed": None,
    "optimizer (a --task brings its own)": None,
    "adapters (LoRA)": None,
    "checkpoints": None,
    "multi-process (jax.distributed)": (
        "Join a job of many processes, one global mesh: give all three, or --distributed to "
        "read them from the cluster's environment (SLURM, Open MPI, Cloud TPU). --devices is "
        "then the job's total; each process feeds its own rows of every batch."
    ),
}
#: what a tag implies: a knob and an adapter's setting are kept by a resume, as the model's
#: shape is; each is taken from the checkpoint where the resumed run does not say
IMPLIED = {
    "knob": ("model_only", "pretrained_takes", "resumed", "resumed_pretrained"),
    "lora": ("resumed", "resumed_pretrained"),
    "shaping": ("model_only", "resumed"),
}
AXIS_TYPES = ("auto", "explicit")  # core.mesh.AXIS_TYPES, without importing JAX here


def setting(*flags: str, part: str, default: Any = None, section: str | None = None,
            tags: tuple[str, ...] = (), trainer: bool = False, flag_default: Any = None,
            **argparse_: Any) -> Any:  # fmt: skip
    """A :class:`RunConfig` field declared with everything about it (see the module);
    ``flag_default``: the flag's default where it differs from the field's (a command that
    does not take the flag leaves the field its own)."""
    tags = frozenset(tags).union(*(IMPLIED.get(t, ()) for t in tags))
    meta = {"flags": flags, "part": part, "section": section, "tags": tags, "trainer": trainer,
            "flag_default": flag_default, "argparse": argparse_}  # fmt: skip
    return dataclasses.field(default=default, metadata=meta)


def probability(text: str) -> float:
    """A probability in [0, 1): a dropout's."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text}")
    return value


def positive(kind: type) -> Any:
    """A positive, finite ``kind`` (int or float)."""

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


def step_range(text: str) -> range:
    """``A:B``: the steps from A to B-1."""
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B, got {text!r}")
    return range(start, stop)


_INT, _FLOAT = positive(int), positive(float)
_OPTIM, _LORA = "optimizer (a --task brings its own)", "adapters (LoRA)"
_MULTI = "multi-process (jax.distributed)"


@dataclasses.dataclass(frozen=True)
class Declared:
    """Everything a command line says about a run; None where a flag was not given (and
    the command does not define it). :class:`shardplug.cli.config.RunConfig` adds what is
    made of it."""

    command: str = "train"
    # what to train: a task, a pretrained checkpoint, or a reference model and its shape
    task: str | None = setting(
        "--task", part="what", metavar="FILE.py:NAME",
        help="your task: a shardplug.Task (or a function returning one) in a file or a module "
        "(package.module:NAME), instead of a reference --model")  # fmt: skip
    model: str | None = setting(
        "--model", part="what", tags=("model_only", "resumed"),
        help="reference model: mlp, classifier, transformer or cnn (default: transformer)")
    adapter: str | None = setting(
        "--adapter", part="what", tags=("model_only", "pretrained_takes", "resumed",
                                        "resumed_pretrained", "shaping"),
        help="the reference model's framework: nnx, linen or equinox")  # fmt: skip
    init_from: str | None = setting(
        "--init-from", part="what", metavar="DIR", tags=("resumed_pretrained",),
        help="start from a pretrained checkpoint in Hugging Face's format (config.json and "
        "safetensors: Llama, Mistral, Qwen2/3, Gemma 3, Mixtral, Phi-3), read straight into the "
        "strategy's layout, instead of a reference --model")  # fmt: skip
    param_dtype: str | None = setting(
        "--param-dtype", part="what", choices=("float32", "bfloat16", "float16"),
        tags=("resumed_pretrained",),
        help="with --init-from: the parameters' dtype (default: as the checkpoint stores "
        "them)")  # fmt: skip
    data: str | None = setting(
        "--data", part="what", metavar="text:FILE_OR_GLOB", tags=("resumed_pretrained",),
        help="with --init-from: fine-tune on your text (a .jsonl file's lines or any other "
        "file each one document), tokenized by the checkpoint's tokenizer and packed into "
        "rows of --sequence tokens")  # fmt: skip
    tokenizer: str | None = setting(
        "--tokenizer", part="what", metavar="DIR", tags=("resumed_pretrained",),
        help="with --data text:...: the directory of the tokenizer.json to use (default: the "
        "--init-from checkpoint's)")  # fmt: skip
    layers: int | None = setting(
        "--layers", part="what", type=_INT, metavar="N", tags=("shaping",),
        help="the transformer's depth, as one layer stack (default 2)")
    remat: str | None = setting(
        "--remat", part="what", choices=("none", "dots", "full", "offload"),
        tags=("model_only", "pretrained_takes", "resumed"),
        help="what each transformer block recomputes in the backward pass; offload "
        "recomputes all of it from the block's input, kept in host memory (default "
        "none)")  # fmt: skip
    experts: int | None = setting(
        "--experts", part="what", type=_INT, metavar="E", tags=("shaping",),
        help="make each transformer MLP a routed mixture of E experts")
    top_k: int | None = setting(
        "--top-k", part="what", type=_INT, metavar="K", tags=("shaping",),
        help="the experts each token runs (default 2)")
    capacity_factor: float | None = setting(
        "--capacity-factor", part="what", type=_FLOAT, metavar="F", tags=("shaping",),
        help="each expert takes at most F x its even share of the tokens; the rest are "
        "dropped (default: none dropped)")  # fmt: skip
    capacity_groups: int | None = setting(
        "--capacity-groups", part="what", type=_INT, metavar="G", tags=("shaping",),
        help="count capacity in G equal groups of consecutive tokens (GShard); G = the "
        "batch's devices keeps ep's all-to-alls at F x the tokens' bytes (default 1: the "
        "whole batch)")  # fmt: skip
    bias_rate: float | None = setting(
        "--bias-rate", part="what", type=_FLOAT, metavar="U", tags=("shaping",),
        help="auxiliary-loss-free balancing (DeepSeek-V3): each step every expert's routing "
        "bias moves by U toward an even load (e.g. 0.001)")  # fmt: skip
    sequence: int | None = setting(
        "--sequence", part="what", type=_INT, metavar="N",
        tags=("size", "resumed", "resumed_pretrained"),
        help="the sequence length: the reference transformer's (default 32), or a --task "
        "function's that takes a sequence")  # fmt: skip
    batch_size: int | None = setting(
        "--batch-size", part="what", type=_INT, tags=("size", "resumed", "resumed_pretrained"),
        help="global batch size (a --task function's, if it takes batch_size)")
    seed: int | None = setting(
        "--seed", part="what", type=seed, tags=("resumed", "resumed_pretrained"),
        trainer=True, help="(default 0, or the checkpoint's)")  # fmt: skip
    devices: int | None = setting(
        "--devices", part="what", type=_INT, trainer=True,
        help="devices to use (default: every GPU or TPU; without one, 8 simulated CPU "
        "devices)")  # fmt: skip
    # the optimizer (a reference model's or a pretrained checkpoint's run; a task's its own)
    optimizer: str | None = setting(
        "--optimizer", part="optimizer", section=_OPTIM, choices=("adam", "adamw", "sgd"),
        tags=("knob",), help="default: adam for a reference model, adamw for --init-from")
    lr: float | None = setting(
        "--lr", part="optimizer", section=_OPTIM, type=_FLOAT,
        tags=("model_only", "pretrained_takes", "resumed", "resumed_pretrained"),
        help="the peak learning rate (default: the model's; 1e-4 for --init-from)")
    weight_decay: float | None = setting(
        "--weight-decay", part="optimizer", section=_OPTIM, type=float, metavar="W",
        tags=("knob",), help="adamw's decoupled weight decay, on every parameter (default "
        "1e-4)")  # fmt: skip
    momentum: float | None = setting(
        "--momentum", part="optimizer", section=_OPTIM, type=float, metavar="M",
        tags=("knob",), help="sgd's momentum (default none)")
    schedule: str | None = setting(
        "--schedule", part="optimizer", section=_OPTIM,
        choices=("constant", "cosine", "linear", "wsd"), tags=("knob",),
        help="after --warmup, the learning rate stays, falls along a cosine or a line to "
        "--end-lr at --decay-steps, or stays and falls over the last 20%% of them "
        "(warmup-stable-decay) (default constant)")  # fmt: skip
    warmup: int | None = setting(
        "--warmup", part="optimizer", section=_OPTIM, type=int, metavar="STEPS",
        tags=("knob",), help="steps of linear warmup from 0 (default 0)")
    decay_steps: int | None = setting(
        "--decay-steps", part="optimizer", section=_OPTIM, type=_INT, metavar="STEPS",
        tags=("knob",), help="where a decaying --schedule ends (default --steps)")
    end_lr: float | None = setting(
        "--end-lr", part="optimizer", section=_OPTIM, type=float, metavar="LR",
        tags=("knob",), help="where a decaying --schedule ends (default 0)")
    clip_norm: float | None = setting(
        "--clip-norm", part="optimizer", section=_OPTIM, type=float, metavar="C",
        tags=("knob",), help="clip each step's gradient to this global norm")
    # low-rank adapters on the frozen model (shardplug.finetuning.lora)
    lora: int | None = setting(
        "--lora", part="lora", section=_LORA, type=_INT, metavar="RANK", tags=("lora",),
        help="train low-rank adapters of this rank on the frozen model, not the model "
        "itself")  # fmt: skip
    lora_alpha: float | None = setting(
        "--lora-alpha", part="lora", section=_LORA, type=_FLOAT, metavar="A", tags=("lora",),
        help="the adapters' scale is A / RANK (default A = RANK)")
    lora_dropout: float | None = setting(
        "--lora-dropout", part="lora", section=_LORA, type=probability, metavar="P",
        tags=("lora",), help="in training, drop each adapter's input with probability P "
        "(PEFT's lora_dropout; default 0, or --lora-from's)")  # fmt: skip
    lora_from: str | None = setting(
        "--lora-from", part="lora", section=_LORA, metavar="DIR", tags=("lora",),
        help="with --init-from: start from PEFT's adapters in DIR (adapter_config.json, "
        "adapter_model.safetensors), their rank, alpha and targets")  # fmt: skip
    lora_quantize: str | None = setting(
        "--lora-quantize", part="lora", section=_LORA, choices=("int8", "int4", "nf4"),
        tags=("lora",),
        help="QLoRA: keep the frozen weights the adapters train on quantized by Qwix, 8-bit "
        "or 4-bit (int4, or nf4: QLoRA's NormalFloat), dequantized a layer at a time in the "
        "forward pass")  # fmt: skip
    lora_targets: str | None = setting(
        "--lora-targets", part="lora", section=_LORA, metavar="REGEX", tags=("lora",),
        help="the weights with adapters: a pattern searched in each parameter's path "
        "(default: the linear layers and experts, by their use in the traced step: not the "
        "head, embeddings, routers or norms)")
    # how: the strategy and the devices
    strategy: str | None = setting(
        "--strategy", part="strategy",
        help="a strategy or parallelisms joined by '+', e.g. fsdp+tp (default: the plainest, "
        "data parallelism)")
    option: tuple[str, ...] = setting(
        "-o", "--option", part="strategy", default=(), action="append", metavar="KEY=VALUE",
        help="a strategy option, e.g. -o min_size=0 for fsdp (repeatable)")
    addon: tuple[str, ...] = setting(
        "--addon", part="how", default=(), action="append", metavar="NAME",
        help="an add-on plugin that wraps the strategy's hooks (repeatable)")
    mesh: str | None = setting(
        "--mesh", part="how", trainer=True,
        help="axis sizes, e.g. data=2,model=4 (a composition sizes the axes left out)")
    axis_name: tuple[str, ...] = setting(
        "--axis-name", part="how", default=(), action="append", metavar="ROLE=NAME",
        help="name a composition's mesh axis as your model does, e.g. model=tp (repeatable)")
    axis_types: str | None = setting(
        "--axis-types", part="how", choices=AXIS_TYPES, trainer=True,
        help="the mesh's axis types: explicit for a model that reshards or gives its einsums "
        "out_sharding (default: chosen for the model; explain says which and why)")  # fmt: skip
    grad_accum: int = setting(
        "--grad-accum", part="how", section="speed", default=1, type=_INT, metavar="K",
        trainer=True,
        help="microbatches per step, inside the compiled step: the update of the whole batch "
        "with the activation memory of 1/K of it (default 1)")  # fmt: skip
    precision: str = setting(
        "--precision", part="how", section="speed", default="auto",
        choices=("auto", "float32", "bf16"), trainer=True,
        help="bf16: bfloat16 forward and backward, float32 parameters and optimizer state; "
        "auto (the default): bf16 where the devices have bfloat16 matrix units (TPU, NVIDIA "
        "A100 and later), float32 elsewhere (CPU)")  # fmt: skip
    # train: the loop, its outputs and its checkpoints (bench: steps per round)
    steps: int | None = setting(
        "--steps", part="train", flag_default=100, type=_INT,
        help="train to this step; with --resume, counting the steps already taken "
        "(default 100)")  # fmt: skip
    log_every: int = setting("--log-every", part="train", default=10, type=_INT, trainer=True)
    skip_memory_check: bool = setting(
        "--skip-memory-check", part="train", default=False, action="store_true",
        help="start even when the compiled step's peak is more than the devices (or, for "
        "simulated CPU devices, the host) have")  # fmt: skip
    data_timeout: float | None = setting(
        "--data-timeout", part="train", type=_FLOAT, metavar="SECONDS", trainer=True,
        help="give up when the data produces no batch for this long (default: wait, saying "
        "so after 30 s)")  # fmt: skip
    plot: Path | None = setting(
        "--plot", part="train", type=Path, metavar="FILE.png",
        help="at the end, a PNG of the loss (and held-out loss) against step")
    metrics_out: Path | None = setting(
        "--metrics-out", part="train", type=Path,
        help="JSON lines, one per step (appended to with --resume)")
    tensorboard: Path | None = setting(
        "--tensorboard", part="train", type=Path, metavar="DIR",
        help="also write the rows as TensorBoard event files into DIR")
    eval_every: int | None = setting(
        "--eval-every", part="train", type=_INT, metavar="K",
        help="evaluate on the task's held-out data every K steps (rows get eval_*)")
    peak_tflops: float | None = setting(
        "--peak-tflops", part="train", type=_FLOAT, metavar="X", trainer=True,
        help="each device's peak TFLOP/s, for MFU where the device is not a known one")
    flops_per_sample: float | None = setting(
        "--flops-per-sample", part="train", type=_FLOAT, metavar="F", trainer=True,
        help="training FLOPs of one sample, for the rows' model_tflops and MFU (default: the "
        "task's own figure, where it has one)")  # fmt: skip
    quiet: bool = setting("--quiet", part="train", default=False, action="store_true",
                          help="no progress bar")  # fmt: skip
    profile_dir: Path | None = setting(
        "--profile", part="train", section="speed", type=Path, metavar="DIR", trainer=True,
        help="write a profiler trace of --profile-steps here (TensorBoard, Perfetto)")
    profile_steps: range = setting(
        "--profile-steps", part="train", section="speed", default=range(3, 6),
        type=step_range, metavar="A:B", trainer=True,
        help="the steps to trace, from A to B-1 (default 3:6)")  # fmt: skip
    checkpoint_dir: Path | None = setting(
        "--checkpoint-dir", part="train", section="checkpoints", type=Path, trainer=True,
        help="save checkpoints here (asynchronously, each device its own shards); "
        "SIGINT/SIGTERM then save and stop")  # fmt: skip
    checkpoint_every: int | None = setting(
        "--checkpoint-every", part="train", section="checkpoints", type=_INT, trainer=True,
        help="steps between checkpoints (default: only at the end)")
    keep: int | None = setting(
        "--keep", part="train", section="checkpoints", type=_INT, trainer=True,
        help="checkpoints to keep (default 3)")
    local_checkpoint_dir: Path | None = setting(
        "--local-checkpoint-dir", part="train", section="checkpoints", type=Path, trainer=True,
        help="a frequent tier of checkpoints in fast local storage (a RAM disk, /dev/shm/RUN): "
        "each host its own shards and a copy of a peer's, the newest two kept; --resume takes "
        "the newest of either tier")  # fmt: skip
    local_checkpoint_every: int | None = setting(
        "--local-checkpoint-every", part="train", section="checkpoints", type=_INT,
        trainer=True, metavar="K", help="steps between the local tier's checkpoints")
    resume: bool = setting(
        "--resume", part="train", section="checkpoints", default=False, action="store_true",
        help="continue from the newest good checkpoint in --checkpoint-dir, with the "
        "checkpoint's model, adapter, seed and batch size unless given; the strategy, devices "
        "and mesh may differ")  # fmt: skip
    on_nonfinite: str = setting(
        "--on-nonfinite", part="train", section="checkpoints", default="stop",
        choices=("stop", "skip"), trainer=True,
        help="a NaN/inf loss: stop with the step and last good checkpoint named (default), or "
        "skip the update and count it")  # fmt: skip
    coordinator: str | None = setting("--coordinator", part="train", section=_MULTI,
                                      metavar="HOST:PORT", help="process 0's address")
    num_processes: int | None = setting("--num-processes", part="train", section=_MULTI,
                                        type=_INT)  # fmt: skip
    process_id: int | None = setting("--process-id", part="train", section=_MULTI, type=int)
    distributed: bool = setting(
        "--distributed", part="train", section=_MULTI, default=False, action="store_true",
        help="join the job the environment describes (jax.distributed.initialize())")


def declared(part: str | None = None) -> list[dataclasses.Field]:
    """The declared settings (of one ``part``), in the order ``--help`` lists them."""
    return [f for f in dataclasses.fields(Declared)
            if f.metadata and (part is None or f.metadata["part"] == part)]  # fmt: skip


def tagged(tag: str) -> tuple[str, ...]:
    """The settings' names a tag (or a tag it implies) marks, in declaration order."""
    return tuple(f.name for f in declared() if tag in f.metadata["tags"])


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """``command``'s declared flags on its ``parser``: each part it takes (:data:`PARTS`),
    each flag in its section (``speed`` leads; on a command without the loop, the parser)."""
    parts = PARTS[command]
    fields = [f for f in declared() if f.metadata["part"] in parts]
    sections: dict[str | None, Any] = {None: parser}
    for title, description in SECTIONS.items():
        if title == "speed" and command != "train":
            sections[title] = parser
        elif any(f.metadata["section"] == title for f in fields):
            sections[title] = parser.add_argument_group(title, description)
    for field in fields:
        meta = field.metadata
        default = field.default if meta["flag_default"] is None else meta["flag_default"]
        if meta["argparse"].get("action") == "append":
            default = list(default)
        sections[meta["section"]].add_argument(*meta["flags"], dest=field.name, default=default,
                                               **meta["argparse"])  # fmt: skip


#: the optimizer's knobs besides ``lr`` (:class:`shardplug.running.optim.Optimizer`'s fields)
KNOBS = tagged("knob")
#: the adapters' flags: any run may take them, a resumed run keeps them
LORA = tagged("lora")
#: what only a reference model takes: a task brings its own
MODEL_ONLY = tagged("model_only")
#: a pretrained model's, from the CLI
PRETRAINED_TAKES = tagged("pretrained_takes")
#: the reference model's, or a task function's that takes them
SIZES = tagged("size")
#: taken from the checkpoint on --resume (a reference model's run; a task's keeps its --task)
RESUMED = tagged("resumed")
#: what shapes the model or its routing: on --resume a flag that disagrees is refused
SHAPING = tagged("shaping")
#: a run --init-from a checkpoint's, taken from the checkpoint on --resume
RESUMED_PRETRAINED = tagged("resumed_pretrained")
#: the settings the Trainer takes, by the same names
TRAINER = tuple(f.name for f in declared() if f.metadata["trainer"])
