"""Reading a compiled step: its HLO's collectives and bytes (``hlo``), its values by name
(``program``), the branch each device takes (``branches``), its time predicted kernel by
kernel (``timing``, ``kernel_time``, on a ``chips`` figure), what ``explain`` reads off it
(``facts``), and the GPUs a step is compiled for without them (``targets``).

May import the rest of ``core``; nothing above it.
"""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (PEP 562)."""
    return submodule(__name__, name)
