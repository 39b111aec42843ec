"""The built-in strategies, one module each, registered through entry points like any other."""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (``shardplug.strategies.two_d`` after ``import shardplug``)."""
    return submodule(__name__, name)
