"""The argument parser of every command."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardplug.cli._common import (
    AXIS_TYPES,
    AXIS_TYPES_HELP,
    _memory,
    _model_arguments,
    _Parser,
    _positive,
    _step_range,
    model_options_arguments,
    seed,
    task_arguments,
)


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
        "With no options: the transformer LM, data parallel, on every GPU (or TPU), or on 8 "
        "simulated CPU devices where there is none.",
    )
    train.add_argument(
        "--strategy", default="dp",
        help="a strategy or parallelisms joined by '+', e.g. fsdp+tp (default: dp)",
    )  # fmt: skip
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
    task_arguments(train)
    model_options_arguments(train)
    train.add_argument(
        "--steps",
        type=_positive(int),
        default=100,
        help="train to this step; with --resume, counting the steps already taken (default 100)",
    )
    train.add_argument(
        "--batch-size", type=_positive(int), default=None,
        help="global batch size (a --task function's, if it takes batch_size)",
    )  # fmt: skip
    train.add_argument(
        "--devices",
        type=_positive(int),
        default=None,
        help="devices to use (default: every GPU or TPU; without one, 8 simulated CPU devices)",
    )
    train.add_argument(
        "--mesh",
        default=None,
        help="axis sizes, e.g. data=2,model=4 (a composition sizes the axes left out)",
    )
    train.add_argument(
        "--axis-name", action="append", default=[], metavar="ROLE=NAME",
        help="name a composition's mesh axis as your model does, e.g. model=tp (repeatable)",
    )  # fmt: skip
    train.add_argument("--axis-types", choices=AXIS_TYPES, default=None, help=AXIS_TYPES_HELP)
    train.add_argument("--seed", type=seed, default=None, help="(default 0, or the checkpoint's)")
    train.add_argument("--lr", type=_positive(float), default=None, help="Adam learning rate")
    train.add_argument("--log-every", type=_positive(int), default=10)
    train.add_argument(
        "--skip-memory-check", action="store_true",
        help="start even when the compiled step's peak is more than the devices (or, for "
        "simulated CPU devices, the host) have",
    )  # fmt: skip
    train.add_argument(
        "--data-timeout", type=_positive(float), default=None, metavar="SECONDS",
        help="give up when the data produces no batch for this long (default: wait, saying "
        "so after 30 s)",
    )  # fmt: skip
    train.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="at the end, a PNG of the loss (and held-out loss) against step",
    )  # fmt: skip
    train.add_argument(
        "--metrics-out",
        type=Path,
        default=None,
        help="JSON lines, one per step (appended to with --resume)",
    )
    train.add_argument(
        "--tensorboard", type=Path, default=None, metavar="DIR",
        help="also write the rows as TensorBoard event files into DIR",
    )  # fmt: skip
    train.add_argument(
        "--eval-every", type=_positive(int), default=None, metavar="K",
        help="evaluate on the task's held-out data every K steps (rows get eval_*)",
    )  # fmt: skip
    train.add_argument(
        "--peak-tflops", type=_positive(float), default=None, metavar="X",
        help="each device's peak TFLOP/s, for MFU where the device is not a known one",
    )  # fmt: skip
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
        choices=("auto", "float32", "bf16"),
        default="auto",
        help="bf16: bfloat16 forward and backward, float32 parameters and optimizer state; "
        "auto (the default): bf16 where the devices have bfloat16 matrix units (TPU, "
        "NVIDIA A100 and later), float32 elsewhere (CPU)",
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
        help="simulated CPU devices per process (default 4); on a machine with NVIDIA GPUs "
        "each process gets an equal block of them instead",
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
    explain.add_argument(
        "--strategy", default="dp", help="a strategy or parallelisms joined by '+' (default: dp)"
    )
    explain.add_argument("--param", default=None, help="parameter to picture (default: largest)")
    explain.add_argument(
        "--all", action="store_true",
        help="a row for every parameter (default: one per layout and reason, layers as *)",
    )  # fmt: skip
    explain.add_argument(
        "--device-memory", type=_memory, default=None, metavar="SIZE",
        help="the device's memory, e.g. 80GB, to compare the peak against",
    )  # fmt: skip
    explain.add_argument("--plot", type=Path, default=None, metavar="FILE", help="PNG picture")
    explain.add_argument("--json", action="store_true", help="print JSON instead of tables")

    recommend = sub.add_parser(
        "recommend",
        help="which installed strategies fit in the device's memory, and which to use",
        description="Compile the step with every installed strategy and composition, read its "
        "peak memory per device and its communication per step, and recommend: of those that "
        "fit, one that moves only parameters and gradients, then the fewest bytes sent.",
    )
    _model_arguments(recommend)
    recommend.add_argument(
        "--device-memory", type=_memory, default=None, metavar="SIZE",
        help="each device's memory, e.g. 80GB or 512MiB (default: what a GPU's backend gives "
        "this process; needed on CPUs)",
    )  # fmt: skip
    recommend.add_argument(
        "--strategies", default=None, metavar="A,B",
        help="the strategies to compare (default: every installed one and composition)",
    )  # fmt: skip
    recommend.add_argument(
        "--longest-sequence", action="store_true",
        help="instead: the longest sequence each strategy fits, one sample per data-parallel "
        "device (the task at other lengths: --sequence, or its function's sequence=)",
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
        help="comma-separated strategies or compositions with a hand-written twin "
        "(default: dp,fsdp,2d,pmap)",
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
    export.add_argument("--out", type=Path, required=True,
                        help="the .npz file to write (with --format hf: a directory)")  # fmt: skip
    export.add_argument(
        "--format", choices=("npz", "hf"), default="npz",
        help="npz, or hf: config.json and model.safetensors in the pretrained family's names "
        "and shapes (a run started --init-from; loadable by Hugging Face transformers)",
    )  # fmt: skip
    export.add_argument(
        "--init-from", default=None, metavar="DIR",
        help="with --format hf: the checkpoint the run started from (default: the one it "
        "recorded)",
    )  # fmt: skip
    export.add_argument(
        "--step", type=_positive(int), default=None, help="which checkpoint (default: newest)"
    )
    export.add_argument(
        "--task", default=None, metavar="FILE.py:NAME",
        help="the task the checkpoint trained: load the exported weights back into its model",
    )  # fmt: skip

    plot = sub.add_parser(
        "plot",
        help="draw a run's loss (and held-out loss) against step, from train --metrics-out",
        description="A PNG of the loss, and the held-out loss where the run evaluated, "
        "against the step, from the JSON lines train --metrics-out wrote.",
    )
    plot.add_argument("metrics", type=Path, help="the JSON lines file (train --metrics-out)")
    plot.add_argument("--out", type=Path, default=None,
                      help="the PNG to write (default: beside the metrics, .png)")  # fmt: skip
    return parser
