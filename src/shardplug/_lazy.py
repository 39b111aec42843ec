"""Submodules loaded on first use, so that ``import shardplug`` is enough to reach any of
them by its dotted name (``shardplug.stack.scan``, ``shardplug.core.compiled.hlo``) as the README
and
docs write them, while importing a package imports none (and no JAX) until one is asked for.
A package does so in its ``__getattr__`` (PEP 562), asked only for names it does not have."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def submodule(package: str, name: str) -> ModuleType:
    """The submodule ``package.name``, imported now; ``AttributeError`` (as for any missing
    attribute) when there is none. Private names are never looked for."""
    public = name.isidentifier() and not name.startswith("_")
    if public and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
