"""The host: the contract (``hookspecs``, ``declared``, ``ops``, ``context``, ``means``), the
step (``step``, ``update``, ``state``, ``shard_grads``, ``precision``, ``memory``), the
registry and composition of plugins (``registry``, ``strategy``, ``compose``,
``fallbacks``), meshes and shardings (``mesh``, ``sharding``, ``devices``, ``cache``), the
one FLOP count (``flops``) and the units every layer prints in (``units``); in its
folders, the operations the step computes (``operations/``) and the readers of a compiled
step (``compiled/``).

Imports nothing above it (the import-linter contracts in pyproject.toml)."""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (``shardplug.core.compiled.hlo`` after ``import shardplug``)."""
    return submodule(__name__, name)
