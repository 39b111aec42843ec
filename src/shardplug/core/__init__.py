"""The host: hook specs, registry, meshes, sharding rules and the trainer."""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (``shardplug.core.hlo`` after ``import shardplug``)."""
    return submodule(__name__, name)
