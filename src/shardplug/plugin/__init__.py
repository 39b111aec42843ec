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

Building blocks: the online softmax a ring of attention is made of, and its fused meetings on
a GPU (:mod:`.attention`),
the grouped product and capacity of a mixture of experts (:mod:`shardplug.moe.kernels`),
a pipeline schedule's record, passes, table and chunk placements (:mod:`.schedule`: what a
package that adds a schedule to pp writes), shardplug's attention kernel for a parallelism's own
attention (:func:`attention_kernel`, its signature :class:`Attention`), a loss's sum and
count for a ``compute_grads`` that cuts the batch into parts (:mod:`shardplug.core.means`,
as ``means``: each part's sums added, divided once), and :func:`override_operation`, to
trace code with one operation in place of another, and a compiled program's structure for a
``check_program`` (:func:`computations`: which computation calls which, each instruction's
opcode; :func:`reached`; :class:`Varying`: which values, and so which conditionals' branches,
differ between devices). pp's engine (its plan, GPipe, the tick
loop that runs a table, the built-in schedules) is pp's own, in
:mod:`shardplug.strategies.pp`.
"""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from shardplug.core import means
from shardplug.core.compiled.facts import Explained, StepFacts
from shardplug.core.compiled.hlo import Instruction, Varying, computations, reached, source_of
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
    sharding_of,
)
from shardplug.core.declared import Capability
from shardplug.core.hookspecs import Axis, hookimpl, hookspec
from shardplug.core.mesh import build_mesh, describe, is_explicit, parse_mesh
from shardplug.core.operations.attention import attention, attention_kernel
from shardplug.core.operations.held import RULES as HELD_RULES
from shardplug.core.operations.held import Hold
from shardplug.core.operations.layer_stack import LAYERS, split_aux
from shardplug.core.operations.roles import Role
from shardplug.core.ops import Attention, Experts, LayerStack, Operations
from shardplug.core.ops import override as override_operation
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
    fold,
    fold_end,
    fold_start,
    fused_here,
    pad_sequence,
    pair_attention,
    softmax_end,
    softmax_join,
    softmax_meet,
    softmax_rows,
    softmax_start,
)
from shardplug.plugin.schedule import (
    KINDS,
    Pass,
    Placement,
    Schedule,
    Table,
    Unscheduled,
    looped,
    tabulate,
    v_shape,
)

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
    "Attention",
    "Axis",
    "Capability",
    "Composed",
    "ConfigError",
    "HELD_RULES",
    "Hold",
    "Role",
    "Experts",
    "Explained",
    "Instruction",
    "KINDS",
    "MeshError",
    "NamedSharding",
    "Operations",
    "P",
    "PartitionSpec",
    "Pass",
    "Placement",
    "PluginError",
    "Schedule",
    "ShardplugWarning",
    "StepFacts",
    "StrategyOptionError",
    "Table",
    "TraceAgain",
    "Varying",
    "Unscheduled",
    "attention",
    "attention_kernel",
    "batch_axes",
    "batch_axis_name",
    "build_mesh",
    "capacity",
    "capacity_per_group",
    "compute_dtype",
    "computations",
    "constrain",
    "describe",
    "fold",
    "fold_end",
    "fold_start",
    "fused_here",
    "grouped_mlp",
    "hookimpl",
    "hookspec",
    "in_microbatches",
    "reached",
    "source_of",
    "is_explicit",
    "kept_assignments",
    "largest_divisible_dim",
    "lay_out",
    "leaf_paths",
    "logical_to_mesh",
    "looped",
    "manual_axes",
    "mesh_axes",
    "means",
    "microbatched",
    "pad_sequence",
    "pair_attention",
    "override_operation",
    "parse_mesh",
    "per_device_program",
    "per_parameter",
    "program_axes",
    "queue_places",
    "shard_largest_dim",
    "sharding_of",
    "softmax_end",
    "softmax_join",
    "softmax_meet",
    "softmax_rows",
    "softmax_start",
    "split_aux",
    "tabulate",
    "v_shape",
    "warn_once",
]
