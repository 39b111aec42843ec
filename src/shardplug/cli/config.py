"""A command's run, as one typed, frozen value: :class:`RunConfig`, made once from the
command line (:meth:`RunConfig.of`) and, on ``--resume``, merged once with the checkpoint's
(:func:`shardplug.cli.resume.resumed`); and what is made from it, each by one function: the strategy
(:func:`strategy_of`), the task (:func:`shardplug.cli.tasks.task_of`) and the Trainer
(:func:`trainer_for`).

The command functions read a ``RunConfig`` for the run; a command's own presentation flags
(``--json``, explain's ``--param``, bench's ``--rounds``) they read from the arguments."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardplug.cli.settings import (
    KNOBS,
    LORA,
    MODEL_ONLY,
    PRETRAINED_TAKES,
    SIZES,
    TRAINER,
    Declared,
)
from shardplug.errors import ConfigError, MeshError, StrategyOptionError

DEFAULTS = {"model": "transformer", "adapter": "nnx", "seed": 0}


@dataclasses.dataclass(frozen=True)
class RunConfig(Declared):
    """Everything a command line says about a run (each setting declared once, in
    :class:`~shardplug.cli.settings.Declared`); None where a flag was not given (and the
    command does not define it). Made by :meth:`of`, never changed: :func:`resumed`
    returns another."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunConfig:
        """The run that parsed arguments describe: each field from the flag of its name."""
        given = {}
        for field in dataclasses.fields(cls):
            if hasattr(args, field.name):
                value = getattr(args, field.name)
                given[field.name] = tuple(value) if isinstance(value, list) else value
        if given.get("plot") is not None:
            given["plot"] = _png(given["plot"])
        return cls(**given)

    def model_options(self) -> dict[str, Any]:
        """The reference model's options given (``layers``, ``remat``, the experts'...): the
        one path to them (checked, stored in the checkpoint's config, given to the model)."""
        from shardplug.models import TRANSFORMER_OPTIONS

        given = {k: getattr(self, k) for k in TRANSFORMER_OPTIONS}
        return {k: v for k, v in given.items() if v}

    def sizes(self) -> dict[str, Any]:
        """``--sequence`` and ``--batch-size`` as given, for a task function that takes them."""
        return {k: getattr(self, k) for k in SIZES if getattr(self, k) is not None}

    def optim(self, lr: float | None = None) -> Any:
        """The :class:`shardplug.running.optim.Optimizer` the flags name, the model's defaults where
        they say nothing (a reference model's ``lr``); a decaying schedule ending at
        ``--steps`` unless ``--decay-steps`` says otherwise."""
        from shardplug.running.optim import Optimizer

        pretrained = self.init_from is not None
        schedule = self.schedule or "constant"
        ends = self.decay_steps
        if ends is None and schedule != "constant":
            ends = self.steps or (self.warmup or 0) + 1  # explain plans: the state is alike
        return Optimizer(
            name=self.optimizer or ("adamw" if pretrained else "adam"),
            lr=self.lr or lr or 1e-4, weight_decay=self.weight_decay, momentum=self.momentum,
            schedule=schedule, warmup=self.warmup or 0, decay_steps=ends,
            end_lr=self.end_lr or 0.0, clip_norm=self.clip_norm)  # fmt: skip

    def recorded(self) -> dict[str, Any]:
        """What a checkpoint keeps of this run, for ``--resume`` and ``export`` to read."""
        adapters = {k: getattr(self, k) for k in LORA if getattr(self, k) is not None}
        if self.lora_from is not None:  # its rank and alpha too: the files may move
            adapters["lora_from"] = str(Path(self.lora_from).resolve())
            from shardplug.pretrained.peft import settings

            adapters["lora_from_rank"], adapters["lora_from_alpha"] = settings(self.lora_from)
        if self.task is not None:
            return {"task": self.task, "seed": self.seed, **adapters}
        if self.init_from is not None:
            return {**_knobs(self.optim()), **adapters,
                "init_from": str(Path(self.init_from).resolve()), "adapter": self.adapter,
                "seed": self.seed, "batch_size": self.batch_size, "lr": self.lr,
                "param_dtype": self.param_dtype, "sequence": self.sequence, "data": self.data,
                "tokenizer": str(Path(self.tokenizer).resolve()) if self.tokenizer else None,
            }  # fmt: skip
        from shardplug.models import get_model

        model = get_model(self.model)
        record = {
            "model": self.model, "adapter": self.adapter, "seed": self.seed,
            "batch_size": self.batch_size or model.batch_size,
            "lr": self.lr or model.learning_rate, **self.model_options(),
            **_knobs(self.optim(model.learning_rate)), **adapters,
        }  # fmt: skip
        if record.get("experts"):
            record.setdefault("top_k", 2)  # recorded, so that a resume can hold to it
        return record


def _knobs(optim: Any) -> dict[str, Any]:
    """An optimizer's knobs as a checkpoint records them (its ``lr`` apart)."""
    recorded = optim.recorded()
    return {"optimizer": recorded.pop("name"), **{k: recorded[k] for k in KNOBS[1:]}}


def check_what(config: RunConfig) -> None:
    """A task brings its own model, data and optimizer: refuse the reference model's flags;
    a pretrained checkpoint its own shape: refuse those that would change it; a reference
    model's options checked against it. Before JAX starts, so a typo costs nothing."""
    data, tokenizer, init_from = config.data, config.tokenizer, config.init_from
    if data is not None and not data.startswith("text:"):
        raise ConfigError(f"--data {data}: give text:FILE_OR_GLOB (a file, directory or glob)")
    if tokenizer is not None and data is None:
        raise ConfigError("--tokenizer tokenizes --data text:...: give the text too")
    if data is not None and init_from is None:
        raise ConfigError(
            "--data text:... fine-tunes a pretrained checkpoint on your text: give "
            "--init-from DIR (a --task brings its own data)"
        )
    if config.lora_from is not None:
        if init_from is None:
            raise ConfigError("--lora-from reads PEFT's adapters of a pretrained family: give "
                              "--init-from DIR, the model they adapt")  # fmt: skip
        for name in ("lora_alpha", "lora_targets"):
            if getattr(config, name) is not None:
                raise ConfigError(f"{_flag(name)}: --lora-from's adapters bring their own")
    elif config.lora is None:
        for name in ("lora_alpha", "lora_targets", "lora_dropout"):
            if getattr(config, name) is not None:
                raise ConfigError(f"{_flag(name)} shapes the adapters: give --lora RANK too")
        if config.lora_quantize is not None:
            raise ConfigError("--lora-quantize stores the frozen base that adapters train on "
                              "(QLoRA): give --lora RANK too")  # fmt: skip
    if config.task is None:
        config.optim()  # a knob that is not one, or knobs that do not go together: one line
    if init_from is not None:
        if config.task is not None:
            raise ConfigError("--init-from and --task both say what to train: give one")
        shape = [_flag(k) for k in MODEL_ONLY
                 if k not in PRETRAINED_TAKES and getattr(config, k) is not None]  # fmt: skip
        if shape:
            raise ConfigError(
                f"{', '.join(shape)} shape the reference model; --init-from {init_from} "
                f"takes its shape from the checkpoint's config.json: drop "
                f"{'them' if len(shape) > 1 else 'it'}"
            )
        return
    if config.param_dtype is not None:
        raise ConfigError("--param-dtype casts a checkpoint's parameters: give --init-from DIR")
    if config.task is not None:
        given = [_flag(k) for k in MODEL_ONLY if getattr(config, k) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set the reference model; --task {config.task} brings its "
                f"own model, optimizer and data: drop {'them' if len(given) > 1 else 'it'}"
            )
        return
    from shardplug.models import check_adapter, get_model

    get_model(config.model or DEFAULTS["model"]).check_options(**config.model_options())
    check_adapter(config.adapter or DEFAULTS["adapter"])


def strategy_of(config: RunConfig, name: str | None = None,
                options: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    r"""The :class:`~shardplug.core.registry.Strategy` of the command line: ``--strategy``
    with its ``-o`` options, or ``name`` (a candidate to compare) with ``options``; each
    with the ``--addon``\s and ``--axis-name``\s. An unknown name or option is one line."""
    from shardplug.core.registry import get_strategy, plain_strategy

    if name is None:
        name = config.strategy if config.strategy is not None else plain_strategy()
        options = parse_options(name, config.option, config.addon)
    return get_strategy(name, addons=list(config.addon), axis_names=axis_names(config.axis_name),
                        **(options or {}))  # fmt: skip


def parse_options(strategy: str, pairs: Sequence[str],
                  addons: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """``["min_size=0"]`` into ``{"min_size": 0}``, typed by the strategy's own signature
    (:meth:`shardplug.StrategyOption.parse`); ``ADDON.KEY=VALUE`` by the add-on's."""
    from shardplug.core.registry import (
        addon_options,
        list_addons,
        split_addons,
        strategy_options,
    )

    known = {o.name: o for o in strategy_options(strategy)}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise StrategyOptionError(f"strategy option {pair!r} is not KEY=VALUE")
        addon, dot, option = key.partition(".")
        if dot and addon in addons and key not in known:
            takes = {o.name: o for o in addon_options(addon)}
            if option not in takes:
                raise StrategyOptionError(
                    f"add-on {addon!r} has no option {option!r}; its options: "
                    f"{', '.join(sorted(takes)) or 'none'}"
                )
            options[key] = takes[option].parse(text)
            continue
        alone = split_addons(strategy)[0]  # pp+offload: pp alone, wrapped
        if key not in known and key.partition(".")[::2] in {(alone, o) for o in known}:
            key = key.partition(".")[2]  # -o pp.schedule=zb for pp alone, as in a composition
        if key not in known:
            takes = ", ".join(sorted(known)) or "none"
            hint = (f" (an option of the add-on {addon!r}: add --addon {addon})"
                    if dot and addon in {a.name for a in list_addons()} else "")  # fmt: skip
            raise StrategyOptionError(
                f"strategy {strategy!r} has no option {key!r}{hint}; its options: {takes}"
            )
        options[key] = known[key].parse(text)
    return options


def axis_names(pairs: Sequence[str]) -> dict[str, str]:
    """``["model=tp"]`` into ``{"model": "tp"}``."""
    names: dict[str, str] = {}
    for pair in pairs:
        role, sep, name = (part.strip() for part in pair.partition("="))
        if not sep or not role.isidentifier() or not name.isidentifier():
            raise MeshError(f"--axis-name {pair!r} is not ROLE=NAME, e.g. model=tp")
        names[role] = name
    return names


def trainer_for(config: RunConfig, task: Any, strategy: Any, *, allocate: bool = True,
                devices: Any = None) -> Any:  # fmt: skip
    """The one Trainer a command builds: ``task``'s (:meth:`shardplug.Task.trainer`) with
    ``strategy`` (:func:`strategy_of`) and every setting the command line gave; on
    ``devices`` where given (a ``--target``'s), else on ``--devices`` of JAX's."""
    given = {k: getattr(config, k) for k in TRAINER if getattr(config, k) is not None}
    if config.command == "train":  # what its checkpoints keep of the run
        given["config"] = config.recorded()
    if devices is not None:
        given["devices"] = devices
    elif config.devices is None and config.mesh:
        given["devices"] = _mesh_devices(config.mesh, strategy)
    return task.trainer(strategy=strategy, allocate=allocate, **given)


def _mesh_devices(mesh: str, strategy: Any) -> int | None:
    """The devices a ``--mesh`` that sizes every axis of the strategy's composition names,
    where they are fewer than JAX has (``--mesh stage=4`` of ``pp`` on 8 devices: 4 of
    them, as asked); None to use every device (the mesh then sizes them, or says why not)."""
    import jax

    from shardplug.core.mesh import parse_mesh

    composition = getattr(strategy, "composition", None)
    shape = parse_mesh(mesh)
    if composition is None or not set(composition.axes) <= set(shape):
        return None
    count = math.prod(shape.values())
    there = len(jax.devices())
    fits = count < there and there % count == 0  # a share of them (data=3 of 8: a typo)
    return count if fits and jax.process_count() == 1 else None


def read_first(data: Any, limit_s: float | None = None) -> Any:
    """The first batch of ``data`` (None if it has none), the wait announced and bounded;
    a :class:`shardplug.running.data.Batches`'s read alone, with no read-ahead beside it."""
    from shardplug.loop.waits import DataWait
    from shardplug.running.data import Batches

    with DataWait(limit_s) as wait, wait.on("the first batch"):
        return data.first() if isinstance(data, Batches) else next(iter(data), None)


def plan_batch(task: Any) -> Any:
    """The task's first batch, to plan (compile, not train) for."""
    batch = read_first(task.batches())
    if batch is None:
        raise ConfigError(f"task {task.name}: its data gave no batch to plan for")
    return batch


#: the formats a picture is drawn in (matplotlib's, by the file's suffix)
PICTURES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".webp", ".gif", ".tif", ".tiff",
            ".eps", ".ps", ".pgf", ".avif", ".raw", ".rgba")


def _png(path: Path, flag: str = "--plot", reads: tuple[Path, ...] = ()) -> Path:
    """Where ``flag`` draws, checked before anything runs: refused at once when it names a
    folder, a format no picture is drawn in, a file the command reads (``reads``) or a
    folder it cannot write in; ``.png`` added when it has no suffix (as matplotlib would);
    its missing folders made."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name the .png file to write in it")
    if path.exists() and not path.is_file():  # a device, a pipe: nothing a picture is kept in
        raise ConfigError(f"{flag} {path} is not a regular file (a device or a pipe): name "
                          f"a .png file to write")  # fmt: skip
    path = path if path.suffix else path.with_suffix(".png")
    if path.suffix.lower() not in PICTURES:
        raise ConfigError(f"{flag} {path}: a picture is drawn as {', '.join(PICTURES)}; name "
                          f"a file ending in one, e.g. {path.with_suffix('.png')}")  # fmt: skip
    if any(path.resolve() == r.resolve() for r in reads):
        other = path.with_name(f"{path.stem}-loss.png")
        raise ConfigError(f"{flag} {path} is the file this command reads, which it never "
                          f"writes: give another, e.g. {flag} {other}")  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot make its folder ({e.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: its folder {path.parent} is not writable")
    return path


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
