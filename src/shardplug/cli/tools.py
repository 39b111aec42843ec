"""``strategies``, ``launch``, ``export`` and ``plot``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from shardplug.cli.watch import quiet_orbax
from shardplug.errors import ConfigError


def cmd_strategies(args: argparse.Namespace) -> int:
    from shardplug.core.registry import list_addons, list_strategies

    kinds = [("strategy", info) for info in list_strategies(include_broken=args.all)]
    if args.all:
        kinds += [("add-on", info) for info in list_addons(include_broken=True)]
    schedules = _schedules()
    if args.json:
        print(json.dumps(_rows(kinds, schedules if args.all else []), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    if args.all:
        table = Table("name", "kind", "source", "hooks", "error")
        for kind, i in kinds:
            shown = kind if kind == "add-on" else i.kind
            table.add_row(i.name, shown, i.source, ", ".join(i.hooks), i.error or "")
        for name, source, _ in schedules:
            table.add_row(name, "schedule", source, "", "")
    else:
        table = Table("strategy", "kind", "description", "source", "options")
        for _, i in kinds:
            kind = f"composition of {i.parts}" if i.kind == "composition" else i.kind
            options = ", ".join(o.name for o in i.options)
            table.add_row(i.name, kind, i.description, i.source, options)
    Console().print(table)
    if not args.all:
        print(
            "Parallelisms compose on one mesh with '+' (--strategy dp+fsdp+tp); a strategy "
            "runs alone."
        )
        listed = ", ".join(f"{name} ({source})" for name, source, _ in schedules)
        print(f"pp's schedules (-o pp.schedule=NAME): {listed}.")
    return 0


def _rows(kinds: list[tuple[str, Any]], schedules: list[tuple[str, str, str]]) -> list[dict]:
    """``strategies --json``: a row for each strategy (add-on), then each schedule given."""
    from importlib.metadata import version

    rows = [{"name": i.name, "kind": kind if kind == "add-on" else i.kind,
             "composes": i.kind != "strategy" and kind != "add-on", "parts": i.parts,
             "description": i.description, "source": i.source, "package": i.package,
             "version": i.version, "options": {o.name: repr(o.default) for o in i.options},
             "hooks": list(i.hooks), "error": i.error} for kind, i in kinds]  # fmt: skip
    for name, source, description in schedules:
        package, _, release = source.rpartition(" ")
        if source == "built-in":
            package, release = "shardplug", version("shardplug")
        rows.append({"name": name, "kind": "schedule", "composes": False, "parts": None,
                     "description": description, "source": source, "package": package,
                     "version": release, "options": {}, "hooks": [], "error": None})  # fmt: skip
    return rows


def _schedules() -> list[tuple[str, str, str]]:
    """Every installed pipeline schedule: its name, where it comes from, what it is; pp's
    own GPipe first."""
    from shardplug.strategies.pp.schedules import installed, sources

    gpipe = ("gpipe", "built-in", "every forward, then the backward pass JAX derives")
    where = sources()
    return [gpipe, *((n, where[n], s.description) for n, s in installed().items())]


#: What a bug report needs to name, in this order: the distributions shardplug is built on.
STACK = ("jax", "jaxlib", "flax", "equinox", "optax", "orbax-checkpoint", "qwix", "grain",
         "numpy")  # fmt: skip


def versions() -> dict[str, str]:
    """The versions of Python, shardplug, :data:`STACK` and every JAX plugin installed (its
    CUDA, ROCm or TPU backends), read from the installed distributions without starting JAX."""
    import importlib.metadata
    import platform

    from shardplug import __version__

    found = {"python": platform.python_version(), "shardplug": __version__}
    for name in STACK:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "libtpu")):
            found[name] = dist.version
    return found


def cmd_env(args: argparse.Namespace) -> int:
    """The versions a bug report names and the devices a run would use."""
    import jax

    from shardplug.core.devices import simulate_cpu_devices

    found = versions()
    simulate_cpu_devices()  # as every command does where there is no accelerator
    devices = jax.devices()
    kinds = sorted({getattr(d, "device_kind", d.platform) for d in devices})
    found["devices"] = f"{len(devices)} {devices[0].platform} ({', '.join(kinds)})"
    print(json.dumps(found, indent=2) if args.json else aligned(found), end="\n" * args.json)
    return 0


def aligned(found: dict[str, str]) -> str:
    """``found`` as lines of a name and its value, the values in one column."""
    width = max(map(len, found))
    return "".join(f"{name:<{width}}  {value}\n" for name, value in found.items())


def cmd_launch(args: argparse.Namespace) -> int:
    from shardplug.running.launch import launch

    command = list(args.command_args)
    if command and command[0] == "--":
        command = command[1:]
    if args.min_nprocs is not None and not args.restarts:
        raise ConfigError("--min-nprocs says how few processes a restarted job may go on "
                          "with: give --restarts N too")  # fmt: skip
    return launch(args.nprocs, args.devices_per_proc, command, restarts=args.restarts,
                  min_nprocs=args.min_nprocs, stall_seconds=args.stall_seconds)  # fmt: skip


def cmd_export(args: argparse.Namespace) -> int:
    quiet_orbax()
    from shardplug.running.export import export_checkpoint, load_exported, load_model
    from shardplug.task import load_task

    if args.format == "hf":
        return _export_hf(args)
    if args.format == "peft":
        return _export_peft(args)
    if args.merge:
        raise ConfigError(
            "--merge writes a LoRA run merged, in its family's format: add --format hf"
        )
    task = load_task(args.task) if args.task is not None else None  # a bad one: nothing written
    path = export_checkpoint(args.checkpoint_dir, args.out, step=args.step)
    arrays, info = load_exported(path)
    total = sum(a.size for name, a in arrays.items() if name.startswith("params/"))
    loaded = ""
    if task is not None:  # the weights must fit the task's model: load them back
        load_model(path, task.adapter)  # CheckpointError: what does not fit, by name
        loaded = f"; loaded back into task {task.name}'s model"
    print(
        f"shardplug: exported step {info['step']} of {args.checkpoint_dir}: "
        f"{total:,} parameters in {len(arrays)} arrays to {path}{loaded}"
    )
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    """``export --format hf``: the run's parameters in its pretrained family's format."""
    from shardplug import pretrained
    from shardplug.errors import ConfigError

    if args.task is not None:
        raise ConfigError("--format hf writes a pretrained family's checkpoint: drop --task")
    step, config = pretrained.export_checkpoint(
        args.checkpoint_dir, args.out, init_from=args.init_from, step=args.step, merge=args.merge
    )
    print(f"shardplug: exported step {step} of {args.checkpoint_dir} as a {config.family} "
          f"checkpoint to {args.out}")  # fmt: skip
    return 0


def _export_peft(args: argparse.Namespace) -> int:
    """``export --format peft``: a LoRA run's adapters alone, as PEFT writes them."""
    from shardplug.pretrained import decoder_name, peft, read_config
    from shardplug.running.checkpoint import Checkpoints

    checkpoints = Checkpoints(args.checkpoint_dir, read_only=True)
    step, meta = checkpoints.read_meta_of(args.step)
    run = meta.get("config", {})
    init_from = args.init_from or run.get("init_from")
    adapters = peft.of_run(run)
    if adapters is None or init_from is None:
        raise ConfigError(f"--format peft writes a --lora run's adapters of a pretrained model; "
                          f"{args.checkpoint_dir}'s run has none")  # fmt: skip
    names = sorted(n for n in meta["arrays"] if n.startswith("params/lora/"))
    arrays = checkpoints.read_arrays(step, names)[1]
    factors: dict[str, list] = {}
    for name in names:
        key, part = name.removeprefix("params/lora/").rsplit("/", 1)
        factors.setdefault(decoder_name(key.replace(".", "/")), [None, None])[
            part == "r"] = arrays[name]  # fmt: skip
    rank, alpha = adapters
    peft.write(args.out, read_config(init_from), {k: tuple(v) for k, v in factors.items()},
               rank, alpha, str(init_from), run.get("lora_dropout") or 0.0)  # fmt: skip
    print(f"shardplug: exported step {step}'s adapters of {args.checkpoint_dir} (rank {rank}, "
          f"{len(factors)} weights) as PEFT's to {args.out}")  # fmt: skip
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """A PNG of a run's loss (and held-out loss) against step, from its metrics file."""
    path = args.metrics
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; give the JSON lines train --metrics-out wrote")
    rows = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not text, so not a metrics file; give the JSON lines "
                          "train --metrics-out wrote") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise ConfigError(
                f"{path}:{number}: not a JSON line (is it train's --metrics-out?)"
            ) from None
    from shardplug.cli.config import _png

    out = _png(args.out or path.with_suffix(".png"), "--out", reads=(path,))
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: row {number} is not an object (is it train's "
                              "--metrics-out?)")  # fmt: skip
        bad = [k for k in ("step", "loss", "eval_loss") if row.get(k) is not None
               and (isinstance(row[k], bool) or not isinstance(row[k], int | float))]  # fmt: skip
        if bad:
            raise ConfigError(f"{path}: row {number}: its {bad[0]} is {row[bad[0]]!r}; train "
                              "--metrics-out writes numbers")  # fmt: skip
    print(f"shardplug: wrote {plot_losses(rows, out, title=path.name)}")
    return 0


def plot_losses(rows: list[dict], out: Path, title: str = "") -> Path:
    """Draw ``rows`` (history rows: ``step``, ``loss``, maybe ``eval_loss``) into ``out``."""
    losses = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None and "step" in r]
    if not losses:
        raise ConfigError(f"{title or out}: no rows with a step and a loss to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*losses, strict=True), label="loss", linewidth=1)
    held = [(r["step"], r["eval_loss"]) for r in rows
            if r.get("eval_loss") is not None and "step" in r]
    if held:
        ax.plot(*zip(*held, strict=True), "o-", label="held-out loss", markersize=3)
    restarts = [r["step"] for r in rows if r.get("restart") and "step" in r]
    for k, step in enumerate(restarts):  # where a launch started the job again
        ax.axvline(step, color="grey", linestyle="--", linewidth=0.8,
                   label="restart" if k == 0 else None)  # fmt: skip
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    drawing = out.with_name(f".{out.stem}.drawing{out.suffix}")  # written whole, then named
    try:
        fig.savefig(drawing, dpi=120)
        os.replace(drawing, out)
    finally:
        drawing.unlink(missing_ok=True)
    plt.close(fig)
    return out
