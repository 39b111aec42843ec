"""shardplug: train JAX models on many devices with a sharding strategy chosen by name.

Every public name is listed here. They load on first use, so that importing the package (as
the pytest plugin does, before JAX may start) imports no JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "shardplug.core.context": ("batch_axis_name",),
    "shardplug.core.devices": ("select_devices", "simulate_cpu_devices"),
    "shardplug.core.hookspecs": ("hookimpl", "hookspec"),
    "shardplug.core.mesh": ("parse_mesh",),
    "shardplug.core.registry": (
        "Strategy",
        "StrategyInfo",
        "StrategyOption",
        "get_strategy",
        "list_addons",
        "list_strategies",
    ),
    "shardplug.core.trainer": ("TrainState", "Trainer"),
    "shardplug.export": ("export_checkpoint", "load_exported", "load_model"),
    "shardplug.errors": (
        "BatchError",
        "CheckpointError",
        "ConfigError",
        "DeviceError",
        "MeshError",
        "NonFiniteError",
        "PluginError",
        "RuleError",
        "ShardplugError",
        "ShardplugWarning",
        "StrategyOptionError",
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

__all__ = [
    "Adapter",
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "MeshError",
    "NonFiniteError",
    "PluginError",
    "ReferenceModel",
    "RuleError",
    "ShardplugError",
    "ShardplugWarning",
    "Strategy",
    "StrategyInfo",
    "StrategyOption",
    "StrategyOptionError",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "UnknownModelError",
    "UnknownStrategyError",
    "batch_axis_name",
    "export_checkpoint",
    "from_equinox",
    "from_linen",
    "from_nnx",
    "get_model",
    "get_strategy",
    "hookimpl",
    "hookspec",
    "list_addons",
    "list_strategies",
    "load_exported",
    "load_model",
    "parse_mesh",
    "select_devices",
    "simulate_cpu_devices",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'shardplug' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from shardplug.core.context import batch_axis_name
    from shardplug.core.devices import select_devices, simulate_cpu_devices
    from shardplug.core.hookspecs import hookimpl, hookspec
    from shardplug.core.mesh import parse_mesh
    from shardplug.core.registry import (
        Strategy,
        StrategyInfo,
        StrategyOption,
        get_strategy,
        list_addons,
        list_strategies,
    )
    from shardplug.core.trainer import Trainer, TrainState
    from shardplug.errors import (
        BatchError,
        CheckpointError,
        ConfigError,
        DeviceError,
        MeshError,
        NonFiniteError,
        PluginError,
        RuleError,
        ShardplugError,
        ShardplugWarning,
        StrategyOptionError,
        TrainingInterrupted,
        UnknownModelError,
        UnknownStrategyError,
    )
    from shardplug.export import export_checkpoint, load_exported, load_model
    from shardplug.models import (
        Adapter,
        ReferenceModel,
        from_equinox,
        from_linen,
        from_nnx,
        get_model,
    )
