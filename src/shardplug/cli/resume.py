"""A ``--resume``: which checkpoint (the newest complete one of either tier), the run it
saved (:func:`saved_run`), the devices it ran on (:func:`on_its_devices`), and the one merge
of the command line with it (:func:`resumed`), which refuses a flag that would change the
model, its data or its optimizer, naming the flag and the checkpoint's value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardplug.cli.config import DEFAULTS, RunConfig, _flag, check_what
from shardplug.cli.settings import KNOBS, LORA, RESUMED, RESUMED_PRETRAINED, SHAPING
from shardplug.errors import CheckpointError, ConfigError


def saved_run(config: RunConfig) -> dict[str, Any]:
    """Check the checkpoint flags; the saved run's configuration on ``--resume`` (else {})."""
    from shardplug.running.checkpoint import saved_config

    directory = config.checkpoint_dir
    if directory is None:
        for flag, value in (("--resume", config.resume or None),
                            ("--checkpoint-every", config.checkpoint_every),
                            ("--keep", config.keep)):  # fmt: skip
            if value is not None:
                raise ConfigError(f"{flag} needs --checkpoint-dir")
        return {}
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--checkpoint-dir {directory} is a file: name a directory")
    local = config.local_checkpoint_dir
    if local is not None and local.exists() and not local.is_dir():
        raise ConfigError(f"--local-checkpoint-dir {local} is a file: name a directory")
    newest = _newest_of(config)
    if config.resume:
        if not directory.exists():
            raise CheckpointError(f"--resume: checkpoint directory {directory} does not exist")
        if newest is None:
            raise CheckpointError(
                f"--resume: {directory} holds no complete checkpoint (it is empty, or every "
                f"save was cut short); train without --resume to start"
            )
        # the newest whose record reads: a damaged one is set aside by the restore, which
        # then falls back to the one before it, whose run this is
        for folder, step in _complete_of(config):
            found = saved_config(folder, step)
            if found:
                return found
        return {}
    if newest is not None:
        raise ConfigError(
            f"{'--checkpoint-dir' if newest[0] == directory else '--local-checkpoint-dir'} "
            f"{newest[0]} already holds checkpoints (newest: step {newest[1]}); pass --resume "
            f"to continue that run, or choose an empty directory"
        )
    return {}


def _complete_of(config: RunConfig) -> list[tuple[Path, int]]:
    """Every complete checkpoint of either tier, as ``(folder, step)``, newest first."""
    from shardplug.running.checkpoint import complete_steps

    found = [(folder, step) for folder in (config.checkpoint_dir, config.local_checkpoint_dir)
             if folder is not None for step in complete_steps(folder)]  # fmt: skip
    return sorted(found, key=lambda f: -f[1])


def _newest_of(config: RunConfig) -> tuple[Path, int] | None:
    """The folder and step of the newest complete checkpoint of either tier, or None."""
    found = _complete_of(config)
    return found[0] if found else None


def ran_on(config: RunConfig) -> dict[str, Any]:
    """On ``--resume``: what the newest checkpoint's run ran on (its devices, mesh and
    strategy), else {}."""
    from shardplug.running.checkpoint import saved_layout

    if not config.resume or config.checkpoint_dir is None:
        return {}
    newest = _newest_of(config)
    return saved_layout(*newest) if newest else {}


def on_its_devices(config: RunConfig) -> tuple[RunConfig, str | None]:
    """A plain ``--resume`` (no ``--devices``, ``--mesh`` or processes named) on the device
    count its checkpoint ran on, and the line that says so; else ``config`` as it is."""
    named = (config.devices, config.mesh, config.coordinator, config.num_processes,
             config.process_id)  # fmt: skip
    if not config.resume or any(v for v in named) or config.distributed:
        return config, None
    devices = ran_on(config).get("devices")
    if not isinstance(devices, int) or devices < 1:
        return config, None
    from shardplug.core.devices import SIMULATED, nvidia_gpus

    gpus = nvidia_gpus()
    if devices == (gpus or SIMULATED) or (gpus and devices > gpus):
        return config, None  # as by default: every device (fewer GPUs here: every one)
    said = (f"shardplug: --resume: on the {devices} device{'s' * (devices > 1)} the "
            f"checkpoint in {config.checkpoint_dir} ran on (--devices N for another count)")
    return dataclasses.replace(config, devices=devices), said


def resumed(config: RunConfig, saved: Mapping[str, Any]) -> RunConfig:
    """``config`` with what it leaves unsaid taken from the checkpoint's run (``saved``, {}
    for a new run), checked: the one merge of the two. A new run gets the defaults."""
    _same_kind(config, saved)
    for name in ("adapter", "sequence", "init_from", "param_dtype", "seed"):
        given, was = getattr(config, name), saved.get(name)
        if name == "init_from" and given is not None:
            given = str(Path(given).resolve())
        if name == "sequence" and was is None and saved.get("model"):
            from shardplug.models import get_model

            was = get_model(saved["model"]).default_sequence
        if given is not None and was is not None and given != was:
            raise ConfigError(_reshaped(config, name, given, f"{name} {was}"))
    if saved.get("init_from") and config.task is None and config.model is None:
        return _filled(config, {k: saved.get(k) for k in RESUMED_PRETRAINED}, saved)
    if config.task is None and saved.get("task") and config.model is None:
        if config.init_from is not None:
            raise ConfigError(
                f"--checkpoint-dir {config.checkpoint_dir} holds a run of task "
                f"{saved['task']}, not one --init-from {config.init_from}: drop --init-from "
                "to resume it, or choose an empty directory"
            )
        task = saved["task"]  # resuming a task's run (the built-in tasks' module renamed)
        if task.startswith("shardplug.tasks:"):
            task = "shardplug.builtin_tasks:" + task.removeprefix("shardplug.tasks:")
        config = dataclasses.replace(config, task=task)
    if config.task is not None or config.init_from is not None:
        kept = {k: saved.get(k) for k in LORA}
        return _filled(config, {"seed": saved.get("seed", DEFAULTS["seed"]), **kept}, saved)
    was_run = saved.get("model") or (saved.get("task") and f"task {saved['task']}")
    if was_run and config.model is not None and config.model != saved.get("model"):
        raise ConfigError(
            f"--checkpoint-dir {config.checkpoint_dir} holds a run of {was_run!s}, not of "
            f"--model {config.model}: drop --model to resume it, or choose an empty directory"
        )
    fill = {}
    for name in RESUMED:
        given, was = getattr(config, name), saved.get(name, DEFAULTS.get(name))
        if name == "top_k" and was is None and saved.get("experts"):
            was = 2  # the default, which checkpoints before top_k was recorded ran
        if saved and name in SHAPING and given is not None and given != was:
            had = f"{name} {was}" if was is not None else f"no {name.replace('_', ' ')}"
            raise ConfigError(_reshaped(config, name, given, had))
        fill[name] = was
    return _filled(config, fill, saved)


def _same_kind(config: RunConfig, saved: Mapping[str, Any]) -> None:
    """A resume of a reference model's run as a pretrained or a task's (or the other way
    round), refused in one line naming both."""
    if not saved:
        return
    was = (f"--init-from {saved['init_from']}" if saved.get("init_from") else
           f"--task {saved['task']}" if saved.get("task") else
           f"--model {saved['model']}" if saved.get("model") else None)  # fmt: skip
    given = (("--init-from", config.init_from) if config.init_from is not None else
             ("--task", config.task) if config.task is not None else
             ("--model", config.model) if config.model is not None else None)  # fmt: skip
    if was is None or given is None or was.startswith(given[0]):
        return
    raise ConfigError(
        f"{given[0]} {given[1]}: the run in {config.checkpoint_dir} trained {was}, and a "
        f"resumed run keeps the model it saved: drop {given[0]} to resume it, or train anew "
        f"in another --checkpoint-dir"
    )


def _reshaped(config: RunConfig, name: str, given: Any, had: str) -> str:
    """The line that refuses a resume whose flag would change the model it saved."""
    why = {"adapter": " (another framework names and lays out its parameters otherwise)",
           "sequence": " (its batches, and the data position that counts them)",
           "init_from": " (another checkpoint's model and weights)",
           "param_dtype": " (its parameters' dtype)",
           "seed": " (its data, and the random keys, are drawn from it)"}  # fmt: skip
    return (
        f"{_flag(name)} {given}: the run in {config.checkpoint_dir} was trained with {had}, and "
        f"a resumed run keeps the model it saved{why.get(name, '')}: drop {_flag(name)}, or "
        f"train anew in another --checkpoint-dir"
    )


def _filled(config: RunConfig, values: Mapping[str, Any], saved: Mapping[str, Any]) -> RunConfig:
    """``config`` with ``values`` where it says nothing, then checked (an optimizer's knob
    that disagrees with the checkpoint's refused: a resumed run continues its optimizer)."""
    for name in (*KNOBS, "lr", *LORA):
        given, was = getattr(config, name), saved.get(name)
        if name == "lora_from" and given is not None:
            given = str(Path(given).resolve())
        recorded = name in saved or (name in LORA and saved)  # a run without adapters: None
        if given is None or not recorded or given == was:
            continue
        had = f"{name.replace('_', ' ')} {was}"
        adapters = saved.get("lora") or saved.get("lora_from")
        if was is None:
            had = "no adapters" if name in LORA else f"the default {name.replace('_', ' ')}"
            if name in LORA and adapters:  # adapters, with this knob at its default
                had = f"adapters of the default {name.replace('_', ' ')}"
            if name == "lora_quantize" and adapters:
                had = "its base unquantized"
        keeps = "its adapters" if name in LORA else "its optimizer and schedule"
        raise ConfigError(
            f"{_flag(name)} {getattr(config, name)}: the run in {config.checkpoint_dir} was "
            f"trained with {had}, and a resumed run continues {keeps}: drop {_flag(name)}, "
            f"or train anew in another --checkpoint-dir"
        )
    config = dataclasses.replace(
        config, **{k: v for k, v in values.items() if getattr(config, k) is None}
    )
    if config.seed is None:
        config = dataclasses.replace(config, seed=DEFAULTS["seed"])
    if saved and config.schedule not in (None, "constant") and config.decay_steps and (
        config.steps or 0) > config.decay_steps:  # fmt: skip
        raise ConfigError(
            f"--steps {config.steps}: the run in {config.checkpoint_dir} has a "
            f"{config.schedule} schedule that ends at step {config.decay_steps} (its first "
            f"run's --steps); the steps after it would train at --end-lr "
            f"{config.end_lr or 0:g}: give --steps {config.decay_steps}, or train anew with "
            f"--decay-steps"
        )
    check_what(config)
    return config
