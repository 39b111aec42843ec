"""Context parallel over the `context` axis: the sequence split across devices.

Every batch leaf's second dimension (the sequence) is split over ``context`` in contiguous
blocks, and so is every activation along it; parameters are replicated over ``context`` (an
``fsdp`` of the same composition stores them split over it too, as torchtitan shards over
dp_shard x cp). Attention sees the whole sequence through :func:`shardplug.attention`: while
the step is traced, :mod:`shardplug.core.sequence` puts in its place ring attention (the
key/value blocks passed round ``context``; ``attention="ring"``, the default by measurement)
or an attention whose keys and values are all-gathered (``attention="gather"``). Causal, the
ring deals each layer's blocks zig-zag for its span and back (``balance="zigzag"``, the
default), so every device computes the same half of the causal work and skips the other;
positions and targets are those of the sequence as it is: nothing outside attention sees an
order but the real one. A model that computes attention otherwise is warned of once: it
trains right, through the compiler's own gathers.
"""

from __future__ import annotations

from typing import ClassVar

from shardplug.plugin import Axis, Capability, StrategyOptionError, hookimpl, sequence_parallel


class ContextParallel:
    """Context parallel: the sequence split over `context`, ring attention over it."""

    unsupported: ClassVar[dict[str, str]] = {
        Capability.WITHOUT_SEQUENCE: "context parallelism splits the batch's sequence; a "
        "model whose batch has none has nothing to split",
        Capability.UNEVEN_SHAPES: "a model of two plain layers has no sequence",
        Capability.BATCH_SPLIT: "context parallelism alone splits the sequence, not the rows",
    }

    def __init__(self, attention: str = "ring", balance: str = "zigzag"):
        if attention not in ("gather", "ring"):
            raise StrategyOptionError(
                f"cp option attention must be 'gather' (keys and values all-gathered) or "
                f"'ring' (passed round the ring), got {attention!r}"
            )
        if balance not in ("zigzag", "none"):
            raise StrategyOptionError(
                f"cp option balance must be 'zigzag' (the ring's causal work dealt evenly) or "
                f"'none' (every block pair computed, masked), got {balance!r}"
            )
        self.attention, self.balance = attention, balance

    @hookimpl
    def parallel_axis(self):
        return Axis("context", rank=Axis.CONTEXT, logical=("length",), lends=True, sequence=True)

    @hookimpl
    def trace_context(self, axis, mesh):
        if mesh.shape[axis] == 1:
            return None
        return sequence_parallel(axis, "cp", self.attention, self.balance == "zigzag")
