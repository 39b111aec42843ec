"""The one namespace a plugin author imports: hooks, mesh and sharding helpers, context.

A composable parallelism::

    from shardplug.plugin import Axis, hookimpl

    class SequenceParallel:
        @hookimpl
        def parallel_axis(self):
            return Axis("sequence", rank=35, logical=("length",))

and a whole strategy implements ``make_mesh``, ``shard_params`` and ``shard_batch`` with
:func:`build_mesh` and the rules below. The hook specifications, with an example each, are
in :mod:`shardplug.core.hookspecs`; docs/plugins.md walks through a published package.
"""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from shardplug.core.attention import attention, attention_override
from shardplug.core.compose import Axis, Composed
from shardplug.core.context import (
    batch_axis_name,
    compute_dtype,
    constrain,
    manual_axes,
    per_device_program,
)
from shardplug.core.declared import Capability
from shardplug.core.experts import expert_parallel, experts_override
from shardplug.core.facts import Explained, StepFacts
from shardplug.core.hookspecs import hookimpl, hookspec
from shardplug.core.layer_stack import LAYERS
from shardplug.core.mesh import build_mesh, describe, parse_mesh
from shardplug.core.schedule import Pipeline, pipelined
from shardplug.core.sequence import sequence_parallel
from shardplug.core.sharding import (
    largest_divisible_dim,
    lay_out,
    leaf_paths,
    logical_to_mesh,
    mesh_axes,
    per_parameter,
    shard_largest_dim,
)
from shardplug.errors import (
    ConfigError,
    MeshError,
    PluginError,
    ShardplugWarning,
    StrategyOptionError,
)

__all__ = [
    "LAYERS",
    "Axis",
    "Capability",
    "Composed",
    "ConfigError",
    "Explained",
    "MeshError",
    "Pipeline",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "PluginError",
    "ShardplugWarning",
    "StepFacts",
    "StrategyOptionError",
    "attention",
    "experts_override",
    "expert_parallel",
    "attention_override",
    "batch_axis_name",
    "build_mesh",
    "compute_dtype",
    "constrain",
    "describe",
    "hookimpl",
    "hookspec",
    "largest_divisible_dim",
    "lay_out",
    "leaf_paths",
    "logical_to_mesh",
    "manual_axes",
    "mesh_axes",
    "parse_mesh",
    "per_device_program",
    "per_parameter",
    "pipelined",
    "sequence_parallel",
    "shard_largest_dim",
]
