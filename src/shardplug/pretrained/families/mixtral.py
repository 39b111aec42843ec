"""Mixtral (``MixtralForCausalLM``): each layer's MLP routed experts, each expert its own
tensors (``w1`` the gate, ``w3`` the up projection, ``w2`` the down) beside the router."""

from __future__ import annotations

import pathlib
from typing import Any

from shardplug.pretrained.config import DecoderConfig
from shardplug.pretrained.families.base import Family, Stored, Tensors, standard


def tensors(c: DecoderConfig) -> Tensors:
    names = standard(c)
    moe = "model.layers.{i}.block_sparse_moe."
    names["layers/router"] = Stored(moe + "gate.weight", transposed=True)
    for n, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        names[f"layers/{n}"] = Stored(f"{moe}experts.{{e}}.{w}.weight", transposed=True)
    return names


def fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    return {"experts": raw.get("num_local_experts", 0), "top_k": raw.get("num_experts_per_tok", 0)}


FAMILY = Family(model_type="mixtral", title="Mixtral", tensors=tensors, fields=fields)
