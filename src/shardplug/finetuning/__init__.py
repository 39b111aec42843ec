"""What fine-tunes a pretrained model: the arithmetic of low-rank adapters, quantized bases
and float8 products.

``lora`` (``LoraAdapter``, ``with_lora``: adapters beside a frozen model's weights),
``quantize`` (a QLoRA base stored by Qwix), ``float8`` (the scaled float8 product and its
rules). Float8's add-on, the plugin a run names with ``--addon float8``, is
``strategies/float8.py``: add-ons are plugins, registered by entry point like a
third-party package's, and import only ``shardplug.plugin``.

May import: ``core``, ``running`` (checkpoints, the optimizer), the facade; never ``cli``.
"""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (PEP 562)."""
    return submodule(__name__, name)
