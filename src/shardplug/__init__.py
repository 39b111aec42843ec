"""shardplug: train JAX models on many devices with a sharding strategy chosen by name.

Every public name is listed once, in ``_EXPORTS`` below, with the module it lives in
(``__all__`` is derived from it). They load on first use, so that importing the package (as
the pytest plugin does, before JAX may start) imports no JAX; so do the submodules
(``shardplug.stack.scan``, ``shardplug.running.data.Batches`` after a plain ``import shardplug``).
Plugin authors import from :mod:`shardplug.plugin`.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardplug import _moved
from shardplug._lazy import submodule

_moved.install()  # the module paths that moved still import, warning once

__version__ = "0.1.0"

_EXPORTS = {
    "shardplug.core.operations.attention": ("attention",),
    "shardplug.core.context": ("batch_axis_name", "compute_dtype", "constrain", "sharding_of"),
    "shardplug.core.devices": ("select_devices", "simulate_cpu_devices"),
    "shardplug.core.compiled.timing": ("StepTime", "predict_step"),
    "shardplug.core.compiled.chips": ("Chip",),
    "shardplug.core.hookspecs": ("hookimpl", "hookspec"),
    "shardplug.core.mesh": ("parse_mesh",),
    "shardplug.core.strategy": ("Strategy", "StrategyInfo", "StrategyOption"),
    "shardplug.core.registry": ("get_strategy", "list_addons", "list_strategies"),
    "shardplug.core.means": ("Mean",),
    "shardplug.core.step": ("TrainState", "weight_roles"),
    "shardplug.trainer": ("Trainer",),
    "shardplug.running.optim": ("Optimizer",),
    "shardplug.finetuning.lora": ("LoraAdapter", "with_lora"),
    "shardplug.task": ("Task", "load_task"),
    "shardplug.running.data": ("Batches",),
    "shardplug.running.export": ("export_checkpoint", "load_exported", "load_model"),
    "shardplug.errors": (
        "BatchError",
        "CheckpointError",
        "CompositionError",
        "ConfigError",
        "DeviceError",
        "MeshError",
        "NonFiniteError",
        "PluginError",
        "PretrainedError",
        "RuleError",
        "ShardplugError",
        "ShardplugWarning",
        "StrategyOptionError",
        "TaskError",
        "TrainingInterrupted",
        "UnknownModelError",
        "UnknownStrategyError",
    ),
    "shardplug.models": (
        "Adapter",
        "ReferenceModel",
        "from_equinox",
        "from_linen",
        "from_nnx",
        "get_model",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        return submodule(__name__, name)
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
