"""Data parallel: every device holds the whole model and a slice of the batch."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.hookspecs import hookimpl
from shardplug.core.mesh import build_mesh


class DataParallel:
    """Data parallel: parameters and optimizer state replicated, batch split over `data`."""

    @hookimpl
    def make_mesh(self, devices, mesh_shape):
        return build_mesh(devices, mesh_shape, default={"data": -1})

    @hookimpl
    def shard_params(self, params):
        return jax.tree.map(lambda _: P(), params)

    @hookimpl
    def shard_batch(self, batch):
        return jax.tree.map(lambda leaf: P("data") if leaf.ndim else P(), batch)
