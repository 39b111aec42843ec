"""The one namespace a plugin author imports: the hooks and their records, mesh and sharding
helpers, the step's context, and the building blocks of the built-in parallelisms.

A composable parallelism::

    from shardplug.plugin import RANK, Axis, hookimpl

    class SequenceParallel:
        @hookimpl
        def parallel_axis(self):
            return Axis("sequence", rank=RANK["context"] + 1, logical=("length",))

and a whole strategy implements ``make_mesh``, ``shard_params`` and ``shard_batch`` with
:func:`build_mesh` and the rules below. The hook specifications, with an example each, are
in :mod:`shardplug.core.hookspecs`, grouped by the phase of a run that calls them;
docs/plugins.md walks through a published package, and examples/cp_gather is a context
parallelism written from this namespace alone.

Building blocks: the online softmax a ring of attention is made of (:mod:`.attention`),
the grouped product and capacity of a mixture of experts (:mod:`shardplug.moe.kernels`),
a pipeline's plan and GPipe schedule (:mod:`.stages`), and the schedules that write the
backward pass in: their tables (:mod:`.schedules`), the tick loop that runs one
(:mod:`.ticks`, :mod:`.chunks`) and a layer's backward pass cut in two (:mod:`.backward`).
"""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from shardplug.core.attention import attention, attention_kernel
from shardplug.core.compose import Composed
from shardplug.core.context import (
    batch_axes,
    batch_axis_name,
    compute_dtype,
    constrain,
    in_microbatches,
    manual_axes,
    microbatched,
    per_device_program,
)
from shardplug.core.declared import Capability
from shardplug.core.facts import Explained, StepFacts
from shardplug.core.hookspecs import Axis, hookimpl, hookspec
from shardplug.core.layer_stack import LAYERS
from shardplug.core.mesh import build_mesh, describe, parse_mesh
from shardplug.core.ops import Attention, Experts, LayerStack, Operations
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
    TraceAgain,
    warn_once,
)
from shardplug.moe.kernels import (
    capacity,
    capacity_per_group,
    grouped_mlp,
    kept_assignments,
    program_axes,
    queue_places,
)
from shardplug.plugin.attention import (
    pad_sequence,
    softmax_end,
    softmax_join,
    softmax_meet,
    softmax_rows,
    softmax_start,
)
from shardplug.plugin.schedules import (
    SCHEDULES,
    Pass,
    Schedule,
    Table,
    Unscheduled,
    find_schedule,
    one_f_one_b,
    tabulate,
    zero_bubble,
)
from shardplug.plugin.stages import (
    Pipeline,
    circular_order,
    joined,
    microbatches,
    pipelined,
    rows_split,
    schedule,
    stack_operation,
)
from shardplug.plugin.ticks import scheduled_grads

#: The built-in parallelisms' axes and their ranks, stated once: the mesh lays axes out in
#: this order (outermost first: replicas across nodes, tensor parallelism on the fastest
#: links), and parameter dimensions are claimed in the reverse order (tensor parallelism
#: first, then the experts, the sequence, fsdp's sharding of what remains, stages). A new
#: parallelism picks a rank between two of them.
RANK: dict[str, int] = {
    "data": 10,
    "stage": 20,
    "fsdp": 30,
    "expert": 33,
    "context": 35,
    "model": 40,
}


__all__ = [
    "LAYERS",
    "LayerStack",
    "RANK",
    "SCHEDULES",
    "Attention",
    "Axis",
    "Capability",
    "Composed",
    "ConfigError",
    "Experts",
    "Explained",
    "MeshError",
    "NamedSharding",
    "Operations",
    "P",
    "PartitionSpec",
    "Pass",
    "Pipeline",
    "PluginError",
    "Schedule",
    "ShardplugWarning",
    "StepFacts",
    "StrategyOptionError",
    "Table",
    "TraceAgain",
    "Unscheduled",
    "attention",
    "attention_kernel",
    "batch_axes",
    "batch_axis_name",
    "build_mesh",
    "capacity",
    "capacity_per_group",
    "circular_order",
    "compute_dtype",
    "constrain",
    "describe",
    "find_schedule",
    "grouped_mlp",
    "hookimpl",
    "hookspec",
    "in_microbatches",
    "joined",
    "kept_assignments",
    "largest_divisible_dim",
    "lay_out",
    "leaf_paths",
    "logical_to_mesh",
    "manual_axes",
    "mesh_axes",
    "microbatched",
    "microbatches",
    "one_f_one_b",
    "pad_sequence",
    "parse_mesh",
    "per_device_program",
    "per_parameter",
    "pipelined",
    "program_axes",
    "queue_places",
    "rows_split",
    "schedule",
    "scheduled_grads",
    "shard_largest_dim",
    "softmax_end",
    "softmax_join",
    "softmax_meet",
    "softmax_rows",
    "softmax_start",
    "stack_operation",
    "tabulate",
    "warn_once",
    "zero_bubble",
]
