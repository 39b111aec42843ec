"""Data parallel: every device holds the whole model and a slice of the batch."""

from __future__ import annotations

from shardplug.plugin import RANK, Axis, hookimpl


class DataParallel:
    """Data parallel: parameters and optimizer state replicated, batch split over `data`."""

    @hookimpl
    def parallel_axis(self):
        return Axis("data", rank=RANK["data"], batch=True)
