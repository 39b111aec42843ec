"""Phi-3 (``Phi3ForCausalLM``): q, k and v stored as one fused ``qkv_proj`` (q's rows, then
k's, then v's), gate and up as one ``gate_up_proj`` (the gate's rows first); the rotary on
the first ``partial_rotary_factor`` of each head's dimensions (1 in Phi-3, 0.75 in
Phi-4-mini). LongRoPE's scaling (Phi-3's 128k checkpoints) is not built: such a config is
refused as any unsupported rotary scaling is."""

from __future__ import annotations

import pathlib
from typing import Any

from shardplug.pretrained.config import DecoderConfig, rope
from shardplug.pretrained.families.base import Family, Stored, Tensors, standard


def tensors(c: DecoderConfig) -> Tensors:
    a, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    names = standard(c)
    for n, offset in (("q", 0), ("k", q), ("v", q + kv)):
        names[f"layers/{n}"] = Stored(a + "qkv_proj.weight", transposed=True, offset=offset)
    for n, offset in (("gate", 0), ("up", c.mlp)):
        names[f"layers/{n}"] = Stored(mlp + "gate_up_proj.weight", transposed=True, offset=offset)
    return names


def fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    """The share of each head the rotary turns: 5.x keeps it in ``rope_parameters``, 4.x
    beside them."""
    theta, scaling = rope(raw, where)
    share = scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor")
    return {"rope_theta": theta, "rope": scaling, "partial_rotary": float(share or 1.0)}


FAMILY = Family(model_type="phi3", title="Phi-3 (Phi3ForCausalLM)", tensors=tensors,
                fields=fields)  # fmt: skip
