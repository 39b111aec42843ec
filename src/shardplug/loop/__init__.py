"""The host-side loop: dispatch and read-ahead, signals, profiling, batch placement."""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (``shardplug.loop.metrics`` after ``import shardplug``)."""
    return submodule(__name__, name)
