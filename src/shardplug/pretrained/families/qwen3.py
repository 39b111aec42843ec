"""Qwen3 (``Qwen3ForCausalLM``): RMSNorm on each head's queries and keys."""

from __future__ import annotations

import pathlib
from typing import Any

from shardplug.pretrained.families.base import Family


def fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    return {"qk_norm": True}


FAMILY = Family(model_type="qwen3", title="Qwen3", fields=fields)
