"""What a command line trains: the ``--task``, a pretrained checkpoint's fine-tuning or a
reference model, with the adapters ``--lora`` or ``--lora-from`` put on it
(:func:`task_of`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from shardplug.cli.config import DEFAULTS, RunConfig
from shardplug.errors import ConfigError


class What(NamedTuple):
    """What a run trains: the task, the pretrained checkpoint it was made of (if one), and
    the optimizer the flags made (a task's own: None)."""

    task: Any
    pretrained: Any = None
    optimizer: Any = None


def task_of(config: RunConfig, sequence: int | None = None,
            batch_size: int | None = None) -> What:  # fmt: skip
    """The :class:`shardplug.Task` the command line names: the ``--task``, a pretrained
    checkpoint's fine-tuning, or the reference ``--model``; at another ``sequence`` (and
    global ``batch_size``) where given, for planning at other lengths. After the devices
    are set: a task file may use JAX as it is imported."""
    sizes = config.sizes()
    if sequence is not None:
        sizes = {"sequence": sequence, "batch_size": batch_size or config.batch_size}
        sizes = {k: v for k, v in sizes.items() if v is not None}
    what = _what(config, sizes)
    if config.lora_from is not None:
        return what._replace(task=_lora_from(config, what))
    if config.lora is None:
        return what
    from shardplug.finetuning.lora import with_lora

    made = with_lora(what.task, config.lora, alpha=config.lora_alpha, targets=config.lora_targets,
                     quantize=config.lora_quantize, dropout=config.lora_dropout or 0.0)  # fmt: skip
    return what._replace(task=made)


def _lora_from(config: RunConfig, what: What) -> Any:
    """The pretrained task with PEFT's adapters from ``--lora-from`` on it."""
    import jax

    from shardplug.core.sharding import leaf_paths
    from shardplug.finetuning.lora import with_lora
    from shardplug.pretrained import decoder_name, peft

    rank, alpha, factors = peft.read(config.lora_from, what.pretrained.config)
    if config.lora is not None and config.lora != rank:
        raise ConfigError(f"--lora {config.lora}: the adapters in {config.lora_from} have rank "
                          f"{rank}; drop --lora")  # fmt: skip
    params, _ = what.task.adapter.abstract(jax.random.key(0))
    initial = {
        p: factors[decoder_name(p)] for p in leaf_paths(params) if decoder_name(p) in factors
    }
    return with_lora(what.task, rank, alpha=alpha, targets=peft.targets_pattern(list(initial)),
                     initial=initial, quantize=config.lora_quantize,
                     dropout=peft.dropout(config.lora_from) if config.lora_dropout is None
                     else config.lora_dropout)  # fmt: skip


def _what(config: RunConfig, sizes: dict[str, Any]) -> What:
    """The run's task before any adapters (:func:`task_of`)."""
    if config.task is not None:
        from shardplug.task import load_task

        return What(load_task(config.task, **sizes))
    if config.init_from is not None:
        from shardplug import pretrained

        loaded = pretrained.load(config.init_from, dtype=config.param_dtype)
        optim = config.optim()
        return What(loaded.task(
            config.adapter or DEFAULTS["adapter"], batch_size=config.batch_size,
            seed=config.seed or 0, sequence=config.sequence, optimizer=optim.build(),
            remat=config.remat or "none", tokenizer=config.tokenizer,
            text=config.data.removeprefix("text:") if config.data else None,
        ), loaded, optim)  # fmt: skip
    from shardplug.models import get_model

    options = {**config.model_options(), **sizes}
    model = get_model(config.model or DEFAULTS["model"])
    optim = config.optim(model.learning_rate)
    return What(model.task(
        config.adapter or DEFAULTS["adapter"], seed=config.seed or 0, optimizer=optim.build(),
        **options,
    ), None, optim)  # fmt: skip
