"""Gemma 3, text (``Gemma3ForCausalLM``): norms scaling by ``1 + weight``, a norm after each
sub-layer as well as before, the embedding scaled by the square root of the width (its
:class:`~shardplug.pretrained.config.Traits`); a tanh-approximated GELU, RMSNorm on queries
and keys, its query scale and its logits' soft cap; sliding layers (with their own rotary
base) among full ones. Configs as transformers 4.x wrote them (``rope_theta`` and
``rope_scaling`` the full layers', ``rope_local_base_freq`` the sliding ones') and as 5.x
writes them (``rope_parameters`` by layer type) read the same."""

from __future__ import annotations

import pathlib
from typing import Any

from shardplug.pretrained.config import DecoderConfig, Traits, rope
from shardplug.pretrained.families.base import Family, Stored, Tensors, standard


def tensors(c: DecoderConfig) -> Tensors:
    """Llama's, with a norm after each sub-layer too and the MLP's own before it."""
    layer = "model.layers.{i}."
    names = standard(c)
    names["layers/post_attention_norm"] = Stored(layer + "post_attention_layernorm.weight")
    names["layers/mlp_norm"] = Stored(layer + "pre_feedforward_layernorm.weight")
    names["layers/post_mlp_norm"] = Stored(layer + "post_feedforward_layernorm.weight")
    return names


def fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    by_type = raw.get("rope_parameters") or {}
    if "full_attention" in by_type:  # 5.x
        theta, scaling = rope(raw, where, by_type["full_attention"])
        local = rope(raw, where, by_type.get("sliding_attention") or {"rope_theta": 10000.0})
    else:  # 4.x: rope_theta and rope_scaling the global layers', rope_local_base_freq
        theta, scaling = rope({"rope_theta": 1e6, **raw}, where)
        local = rope(raw, where, {"rope_theta": raw.get("rope_local_base_freq", 1e4)})
    pattern = raw.get("sliding_window_pattern", 6)
    layers = raw.get("num_hidden_layers", 0)
    kinds = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    scalar = raw.get("query_pre_attn_scalar")
    return dict(
        rope_theta=theta,
        rope=scaling,
        local_rope=local,
        layer_types=tuple("sliding" if k == "sliding_attention" else "full" for k in kinds),
        qk_norm=True,
        tied=bool(raw.get("tie_word_embeddings", True)),  # Gemma's are tied unless said
        query_scale=float(scalar) ** -0.5 if scalar else None,
        final_softcap=raw.get("final_logit_softcapping"),
    )


FAMILY = Family(
    model_type="gemma3_text",
    title="Gemma 3 (text: Gemma3ForCausalLM)",
    tensors=tensors,
    traits=Traits(norm_plus_one=True, post_norms=True, embed_scale=True),
    fields=fields,
    activation=("hidden_activation", "gelu_pytorch_tanh"),
)
