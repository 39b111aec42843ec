"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): biases on q, k and v, always; a sliding window
only where ``use_sliding_window`` says so."""

from __future__ import annotations

import pathlib
from typing import Any

from shardplug.pretrained.families.base import Family


def fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    return {"qkv_bias": True, "sliding_window": sliding}


FAMILY = Family(model_type="qwen2", title="Qwen2/Qwen2.5", fields=fields)
