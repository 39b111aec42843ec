"""Tensor parallel (Megatron-style) over the `model` axis.

Parameters are split along the dimensions their logical names map to the axis (the MLP's
hidden units, the attention heads, the vocabulary); the compiler inserts the activation
all-reduces this implies. Alone it replicates the batch; ``dp+tp`` (``2d``) and ``fsdp+tp``
split the batch over the other axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from shardplug.plugin import (
    RANK,
    Axis,
    Capability,
    StrategyOptionError,
    hookimpl,
    largest_divisible_dim,
)

DEFAULT_RULES = ("mlp", "heads", "vocab", "model")


class TensorParallel:
    """Tensor parallel: parameters split over `model` by their logical names.

    :param rules: the logical axis names to split over the axis (a mapping ``name -> "model"``
        is accepted too); other dimensions stay whole. A dimension the model names by the
        axis's own name is always split. Parameters without annotations have their largest
        dimension that divides the axis split when they hold at least ``min_size`` elements.
    :param min_size: the size below which unannotated parameters stay replicated.
    """

    unsupported: ClassVar[dict[str, str]] = {
        Capability.BATCH_SPLIT: "tensor parallelism alone replicates the batch"
    }

    def __init__(
        self, rules: Mapping[str, str] | tuple[str, ...] | None = None, min_size: int = 1024
    ):
        if rules is None:
            rules = DEFAULT_RULES
        if isinstance(rules, str):
            rules = tuple(r.strip() for r in rules.split(",") if r.strip())
        if isinstance(rules, Mapping):
            bad = {k: v for k, v in rules.items() if v != "model"}
            if bad:
                raise StrategyOptionError(f"tp rules may only map onto 'model', got {bad}")
            rules = tuple(rules)
        if not isinstance(min_size, int) or min_size < 0:
            raise StrategyOptionError(
                f"tp option min_size must be a non-negative integer, got {min_size!r}"
            )
        self.rules = tuple(rules)
        self.min_size = min_size

    @hookimpl
    def parallel_axis(self):
        return Axis("model", rank=RANK["model"], logical=self.rules, lends=True)

    @hookimpl
    def split_param(self, shape, logical, axis, size, taken):
        names = list(logical)
        if names:  # the model's own names decide; a dimension it names by the axis comes first
            for dim, name in sorted(enumerate(names), key=lambda e: e[1] != axis):
                wanted = name == axis or name in self.rules
                if wanted and dim not in taken and dim < len(shape) and shape[dim] % size == 0:
                    return dim
            return None
        if math.prod(shape) < max(self.min_size, 1):
            return None
        dim = largest_divisible_dim(tuple(shape), size)
        return None if dim is None or dim in taken else dim
