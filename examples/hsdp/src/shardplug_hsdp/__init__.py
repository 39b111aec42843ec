"""Hybrid sharded data parallel (HSDP) as a shardplug strategy.

The devices form a (``replica``, ``fsdp``) mesh. Inside a replica group parameters and
optimizer state are split as in ZeRO-3; across groups they are replicated, so the
parameter all-gathers stay inside a group (a fast island such as one host) and only the
gradient reduction crosses groups. The batch is split over both axes.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.mesh import build_mesh
from shardplug.core.sharding import lay_out, per_parameter, shard_largest_dim


class HybridShardedDataParallel:
    """Hybrid sharded data parallel: FSDP within `fsdp` groups, replicated across `replica`.

    :param replicas: how many replica groups; by default the largest divisor of the device
        count not above its square root (8 devices: 2 groups of 4).
    :param min_size: arrays with fewer elements stay replicated.
    """

    def __init__(self, replicas: int | None = None, min_size: int = 1024):
        if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
            raise shardplug.StrategyOptionError(
                f"hsdp option replicas must be a positive integer, got {replicas!r}"
            )
        self.replicas = replicas
        self.min_size = min_size

    @shardplug.hookimpl
    def make_mesh(self, devices, mesh_shape):
        if mesh_shape is not None:
            return build_mesh(devices, mesh_shape, default={"replica": 1, "fsdp": 1})
        n = len(devices)
        replicas = self.replicas or max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        if n % replicas:
            raise shardplug.MeshError(f"hsdp: {replicas} replica groups do not divide {n} devices")
        return build_mesh(devices, None, default={"replica": replicas, "fsdp": -1})

    @shardplug.hookimpl
    def shard_params(self, params, mesh, annotations):
        def rule(shape, logical):
            if "embed" in logical:  # follow the model's hint where it divides
                dim = list(logical).index("embed")
                if shape[dim] % mesh.shape["fsdp"] == 0 and math.prod(shape) >= self.min_size:
                    return P(*("fsdp" if i == dim else None for i in range(dim + 1)))
            return shard_largest_dim(shape, "fsdp", mesh, self.min_size)

        return per_parameter(rule, params, annotations)

    @shardplug.hookimpl
    def shard_batch(self, batch):
        return jax.tree.map(lambda leaf: P(("replica", "fsdp")) if leaf.ndim else P(), batch)

    @shardplug.hookimpl
    def gather_params(self, params, mesh):
        whole = NamedSharding(mesh, P())
        return jax.tree.map(lambda p: lay_out(p, whole), params)
