"""Fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state split.

Every device holds 1/N of each large parameter and of its optimizer state. The compiled step
all-gathers a parameter where it is used and reduce-scatters its gradient, so the per-device
memory for the model falls with the device count while the batch is split as in ``dp``.
Composed with ``tp`` it splits a dimension tensor parallelism left whole, and gathers over
its own axis only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardplug.plugin import RANK, Axis, P, StrategyOptionError, hookimpl, largest_divisible_dim


class FullyShardedDataParallel:
    """Fully sharded data parallel (ZeRO-3): parameters and optimizer state split over `fsdp`.

    :param min_size: arrays with fewer elements stay replicated (biases, norms).
    :param prefer: logical axis names to split, in order of preference, when the model
        carries annotations; the first annotated dimension of these names that divides the
        axis is split (a dimension the model names by this axis's own name comes first).
        Parameters whose annotations name none of them, or whose dimensions do not divide,
        fall back to the size rule: split the largest free dimension that divides the axis.
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
    def parallel_axis(self):
        return Axis("fsdp", rank=RANK["fsdp"], batch=True)

    @hookimpl
    def split_param(self, shape, logical, axis, size, taken, spare):
        if math.prod(shape) < max(self.min_size, 1):
            return None
        dim = self._dim(shape, logical, axis, size, taken)
        if dim is None:
            return None
        # What tensor parallelism leaves whole is stored over its axis too: gathered at use
        # either way, it then takes 1/N of every device's memory, not 1/fsdp.
        lent = math.prod(spare.values())
        if spare and shape[dim] % (size * lent) == 0:
            return dim, tuple(spare)
        return dim

    def _dim(self, shape, logical, axis, size, taken):
        names = list(logical)
        for wanted in (axis, *self.prefer):
            if wanted in names:
                dim = names.index(wanted)
                if dim not in taken and shape[dim] % size == 0:
                    return dim
        free = tuple(0 if d in taken else n for d, n in enumerate(shape))  # 0: never largest
        dim = largest_divisible_dim(free, size)
        return None if dim is None or dim in taken else dim

    @hookimpl
    def gather_param(self, spec, axis):
        # Gather each parameter where the step uses it. Left alone, the compiler may instead
        # keep weights split and move activations (all-to-alls, activation all-reduces),
        # which is tensor parallelism by accident, not ZeRO-3. The gradient flows back
        # through the same constraint and is reduced onto each device's shard.
        def mine(entry):
            return entry == axis or (isinstance(entry, tuple) and axis in entry)

        return P(*(None if mine(entry) else entry for entry in spec))
