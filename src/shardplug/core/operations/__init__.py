"""The operations a step computes, each one way under every strategy: attention and its
fused kernels (``attention``, ``flash``, ``flash_pairs``), a layer stack's scan and its
per-layer gather (``layer_stack``, ``layer_gather``), rematerialisation by name
(``remat``), and weights kept as parts: made beside a frozen weight (``beside``, LoRA's),
held by an add-on (``held``, float8's), the forward pass rewritten around them
(``rewrite``); what each weight does in the traced loss (``roles``: LoRA's and float8's
default targets). Which of them a parallelism may compute its own way is ``core/ops.py``, part
of the contract.

May import the rest of ``core``; nothing above it.
"""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (PEP 562)."""
    return submodule(__name__, name)
