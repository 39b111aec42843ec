"""Fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state split.

Every device holds 1/N of each large parameter and of its optimizer state. The compiled step
all-gathers a parameter where it is used and reduce-scatters its gradient, so the per-device
memory for the model falls with the device count while the batch is split as in ``dp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.hookspecs import hookimpl
from shardplug.core.mesh import build_mesh
from shardplug.core.sharding import per_parameter, shard_largest_dim
from shardplug.errors import StrategyOptionError

AXIS = "fsdp"


class FullyShardedDataParallel:
    """Fully sharded data parallel (ZeRO-3): parameters and optimizer state split over all devices.

    :param min_size: arrays with fewer elements stay replicated (biases, norms).
    :param prefer: logical axis names to split, in order of preference, when the model
        carries annotations; the first annotated dimension of these names that divides the
        device count is split. Parameters whose annotations name none of them, or whose
        dimensions do not divide, fall back to the size rule: split the largest dimension
        that divides the device count.
    """

    def __init__(
        self,
        min_size: int = 1024,
        prefer: Sequence[str] = ("embed", "mlp", "heads", "vocab"),
    ):
        if not isinstance(min_size, int) or min_size < 0:
            raise StrategyOptionError(
                f"fsdp option min_size must be a non-negative integer, got {min_size!r}"
            )
        if isinstance(prefer, str):
            prefer = tuple(p.strip() for p in prefer.split(",") if p.strip())
        self.min_size = min_size
        self.prefer = tuple(prefer)

    @hookimpl
    def make_mesh(self, devices, mesh_shape):
        return build_mesh(devices, mesh_shape, default={AXIS: -1})

    @hookimpl
    def shard_params(self, params, mesh, annotations):
        return per_parameter(
            lambda shape, logical: self._spec(shape, logical, mesh), params, annotations
        )

    def _spec(self, shape, logical, mesh):
        if math.prod(shape) < max(self.min_size, 1):
            return P()
        names = list(logical)
        for wanted in self.prefer:
            if wanted in names:
                dim = names.index(wanted)
                if shape[dim] % mesh.shape[AXIS] == 0:
                    return P(*(AXIS if i == dim else None for i in range(dim + 1)))
        return shard_largest_dim(shape, AXIS, mesh, self.min_size)

    @hookimpl
    def gather_params(self, params, mesh):
        # Gather each parameter where the step uses it. Left alone, the compiler may instead
        # keep weights split and move activations (all-to-alls, activation all-reduces),
        # which is tensor parallelism by accident, not ZeRO-3. The gradient flows back
        # through the same constraint and is reduced onto each device's shard.
        whole = NamedSharding(mesh, P())
        return jax.tree.map(lambda p: jax.lax.with_sharding_constraint(p, whole), params)

    @hookimpl
    def shard_batch(self, batch):
        return jax.tree.map(lambda leaf: P(AXIS) if leaf.ndim else P(), batch)
