"""shardplug: train JAX models on many devices with a sharding strategy chosen by name."""

from shardplug.core.context import batch_axis_name
from shardplug.core.devices import select_devices, simulate_cpu_devices
from shardplug.core.hookspecs import hookimpl, hookspec
from shardplug.core.mesh import parse_mesh
from shardplug.core.registry import (
    Strategy,
    StrategyInfo,
    StrategyOption,
    get_strategy,
    list_strategies,
)
from shardplug.core.trainer import Trainer, TrainState
from shardplug.errors import (
    BatchError,
    ConfigError,
    DeviceError,
    MeshError,
    PluginError,
    RuleError,
    ShardplugError,
    StrategyOptionError,
    UnknownModelError,
    UnknownStrategyError,
)
from shardplug.models import (
    Adapter,
    ReferenceModel,
    from_equinox,
    from_linen,
    from_nnx,
    get_model,
)

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "BatchError",
    "ConfigError",
    "DeviceError",
    "MeshError",
    "PluginError",
    "ReferenceModel",
    "RuleError",
    "ShardplugError",
    "Strategy",
    "StrategyInfo",
    "StrategyOption",
    "StrategyOptionError",
    "TrainState",
    "Trainer",
    "UnknownModelError",
    "UnknownStrategyError",
    "__version__",
    "batch_axis_name",
    "from_equinox",
    "from_linen",
    "from_nnx",
    "get_model",
    "get_strategy",
    "hookimpl",
    "hookspec",
    "list_strategies",
    "parse_mesh",
    "select_devices",
    "simulate_cpu_devices",
]
