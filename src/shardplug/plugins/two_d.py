"""A 2D (data, model) mesh: tensor parallel within a row of devices, data parallel across rows.

Parameters are split over ``model`` along the dimensions their logical names map there (the
MLP's hidden units, the attention heads, the vocabulary), Megatron-style, and replicated over
``data``; the batch is split over ``data`` and each row of ``model`` devices sees the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.hookspecs import hookimpl
from shardplug.core.mesh import build_mesh
from shardplug.core.sharding import logical_to_mesh, per_parameter, shard_largest_dim
from shardplug.errors import StrategyOptionError

DEFAULT_RULES = {"mlp": "model", "heads": "model", "vocab": "model", "model": "model"}


def default_split(count: int) -> dict[str, int]:
    """``model`` takes the largest divisor of the device count not above its square root.

    8 devices give data=4, model=2: tensor parallelism talks every layer, so it is kept to the
    smaller factor.
    """
    model = max(d for d in range(1, math.isqrt(count) + 1) if count % d == 0)
    return {"data": count // model, "model": model}


class DataModelParallel:
    """2D mesh: tensor-parallel parameters over `model`, batch over `data`.

    :param rules: logical axis name -> ``"model"`` for the dimensions to split; others stay
        whole. Parameters without annotations have their largest dimension that divides
        ``model`` split when they hold at least ``min_size`` elements.
    :param min_size: the size below which unannotated parameters stay replicated.
    """

    def __init__(self, rules: Mapping[str, str] | None = None, min_size: int = 1024):
        rules = dict(DEFAULT_RULES if rules is None else rules)
        bad = {k: v for k, v in rules.items() if v != "model"}
        if bad:
            raise StrategyOptionError(f"2d rules may only map onto 'model', got {bad}")
        if not isinstance(min_size, int) or min_size < 0:
            raise StrategyOptionError(
                f"2d option min_size must be a non-negative integer, got {min_size!r}"
            )
        self.rules = rules
        self.min_size = min_size

    @hookimpl
    def make_mesh(self, devices, mesh_shape):
        default = default_split(len(devices)) if mesh_shape is None else {"data": 1, "model": 1}
        return build_mesh(devices, mesh_shape, default=default)

    @hookimpl
    def shard_params(self, params, mesh, annotations):
        return per_parameter(
            lambda shape, logical: self._spec(shape, logical, mesh), params, annotations
        )

    def _spec(self, shape, logical, mesh):
        if len(logical):
            return logical_to_mesh(shape, logical, self.rules, mesh)
        return shard_largest_dim(shape, "model", mesh, self.min_size)

    @hookimpl
    def shard_batch(self, batch):
        return jax.tree.map(lambda leaf: P("data") if leaf.ndim else P(), batch)
