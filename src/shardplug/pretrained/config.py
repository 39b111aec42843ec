"""A checkpoint's ``config.json``, read into the one decoder shardplug builds for every family.

Llama (2, 3, 3.1/3.2), Mistral, Qwen2, Qwen3, Gemma 3 and Mixtral are one architecture with
switches: RMSNorm before each sub-layer, rotary positions, grouped-query attention, a gated
MLP (or Mixtral's routed experts). What differs is read from the config: biases on q/k/v
(Qwen2), RMSNorm on each head's queries and keys (Qwen3, Gemma 3), the output tied to the
embedding, the rotary frequencies' scaling (Llama 3.1's ``llama3``, ``linear``), sliding-window
attention (Mistral; Gemma 3's local layers, with their own rotary base), the experts; and
Gemma's ways: norms scaling by ``1 + weight``, a norm after each sub-layer as well as before,
the embedding scaled by the square root of the width, a tanh-approximated GELU, its query
scale and its logits' soft cap. Configs as transformers 4.x wrote them (``rope_theta``,
``rope_scaling``, Gemma's ``rope_local_base_freq``) and as 5.x writes them
(``rope_parameters``, per layer type for Gemma) read the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

from shardplug.errors import PretrainedError

#: ``model_type`` -> the family's name in messages; each reads into :class:`DecoderConfig`
FAMILIES = {
    "llama": "Llama 2/3/3.1/3.2",
    "mistral": "Mistral",
    "qwen2": "Qwen2/Qwen2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text: Gemma3ForCausalLM)",
    "mixtral": "Mixtral",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # the config's name -> ours
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shape and switches, as a checkpoint's ``config.json`` gives them."""

    family: str
    vocab: int
    width: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope: dict[str, Any] = dataclasses.field(default_factory=dict)  # type and its numbers
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    router_aux_loss: float = 0.0
    sliding_window: int | None = None
    #: each layer's attention: "full", or "sliding" within ``sliding_window`` (when set)
    layer_types: tuple[str, ...] = ()
    #: the rotary ``(theta, scaling)`` of the sliding layers, when theirs differ (Gemma 3)
    local_rope: tuple[float, dict[str, Any]] | None = None
    activation: str = "silu"  # or "gelu_tanh"
    gemma: bool = False  # norms by 1 + weight, post-norms, the embedding scaled by sqrt(width)
    query_scale: float | None = None  # the attention's scale, when not 1/sqrt(head_dim)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    max_positions: int | None = None
    dtype: str = "float32"  # as stored: config.json's ``torch_dtype`` / ``dtype``
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def params_count(self) -> int:
        """The number of parameters (what the checkpoint holds)."""
        attention = self.width * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.heads + 2 * self.kv_heads)
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * self.width * self.mlp * max(self.experts, 1) + self.width * self.experts
        per_layer = attention + mlp + (4 if self.gemma else 2) * self.width
        head = 0 if self.tied else self.vocab * self.width
        return self.layers * per_layer + self.vocab * self.width + head + self.width

    def inverse_frequencies(self, local: bool = False) -> list[float]:
        """Rotary frequencies of each pair of a head's dimensions, the scaling applied (of the
        sliding layers' rotary, with ``local``, where it differs)."""
        theta, rope = self.local_rope if local and self.local_rope else (self.rope_theta,
                                                                         self.rope)  # fmt: skip
        d = self.head_dim
        inv = [1.0 / theta ** (i / d) for i in range(0, d, 2)]
        kind = rope.get("rope_type", "default")
        if kind == "linear":
            return [f / rope["factor"] for f in inv]
        if kind == "llama3":  # Llama 3.1: long wavelengths scaled down, a smooth band between
            factor, low, high = (rope[k] for k in ("factor", "low_freq_factor",
                                                   "high_freq_factor"))  # fmt: skip
            old = rope["original_max_position_embeddings"]
            out = []
            for f in inv:
                wavelength = 2 * math.pi / f
                if wavelength < old / high:
                    out.append(f)
                elif wavelength > old / low:
                    out.append(f / factor)
                else:
                    smooth = (old / wavelength - low) / (high - low)
                    out.append((1 - smooth) * f / factor + smooth * f)
            return out
        return inv


def _need(raw: dict, key: str, where: pathlib.Path) -> Any:
    if key not in raw:
        raise PretrainedError(f"{where}: config.json has no {key!r}, which a decoder needs")
    return raw[key]


def _rope(raw: dict, where: pathlib.Path, params: dict | None = None) -> tuple[float, dict]:
    """``(theta, scaling)`` from 5.x's ``rope_parameters`` (or ``params``, one layer type's)
    or 4.x's ``rope_theta`` and ``rope_scaling`` (whose type was once called ``type``)."""
    params = dict(params if params is not None else raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise PretrainedError(
            f"{where}: rotary scaling {kind!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    params["rope_type"] = kind
    return theta, params


def read_config(directory: str | pathlib.Path) -> DecoderConfig:
    """The :class:`DecoderConfig` of a checkpoint directory (its ``config.json``)."""
    where = pathlib.Path(directory)
    path = where / "config.json"
    if not where.is_dir():
        raise PretrainedError(f"{where}: no such directory (give a checkpoint's directory)")
    if not path.is_file():
        raise PretrainedError(
            f"{where}: no config.json there; a pretrained checkpoint's directory holds "
            "config.json and its *.safetensors"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"{path}: not readable JSON ({e})") from None
    family = raw.get("model_type")
    if family not in FAMILIES:
        named = family or ", ".join(raw.get("architectures") or []) or "none given"
        raise PretrainedError(
            f"{where}: architecture {named!r} is not supported; supported: "
            + ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
        )
    gemma = family == "gemma3_text"
    act = raw.get("hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma
                  else "silu")  # fmt: skip
    if act not in ACTIVATIONS or (act != "silu") != gemma:
        raise PretrainedError(f"{where}: activation {act!r} is not built for {family}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag) and family != "qwen2":
            raise PretrainedError(f"{where}: {flag}: true is not built (only Qwen2's q/k/v biases)")
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(flag):
            raise PretrainedError(f"{where}: {flag} {raw[flag]!r} is not built")
    width, heads = _need(raw, "hidden_size", where), _need(raw, "num_attention_heads", where)
    layers = _need(raw, "num_hidden_layers", where)
    sliding = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    local_rope = None
    if gemma:  # sliding layers with their own rotary base; the full ones scaled
        by_type = raw.get("rope_parameters") or {}
        if "full_attention" in by_type:  # 5.x
            theta, rope = _rope(raw, where, by_type["full_attention"])
            local_rope = _rope(raw, where, by_type.get("sliding_attention") or
                               {"rope_theta": 10000.0})  # fmt: skip
        else:  # 4.x: rope_theta and rope_scaling the global layers', rope_local_base_freq
            theta, rope = _rope({"rope_theta": 1e6, **raw}, where)
            local_rope = _rope(raw, where, {"rope_theta": raw.get("rope_local_base_freq", 1e4)})
        pattern = raw.get("sliding_window_pattern", 6)
        kinds = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        types = tuple("sliding" if k == "sliding_attention" else "full" for k in kinds)
    else:
        theta, rope = _rope(raw, where)
        types = ("sliding" if sliding else "full",) * layers
    if len(types) != layers:
        raise PretrainedError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    scalar = raw.get("query_pre_attn_scalar") if gemma else None
    return DecoderConfig(
        family=family,
        vocab=_need(raw, "vocab_size", where),
        width=width,
        mlp=_need(raw, "intermediate_size", where),
        layers=layers,
        heads=heads,
        kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or width // heads,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope=rope,
        qkv_bias=family == "qwen2",  # Qwen2's q, k and v always have biases
        qk_norm=family in ("qwen3", "gemma3_text"),
        tied=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma's are tied unless said
        experts=raw.get("num_local_experts", 0) if family == "mixtral" else 0,
        top_k=raw.get("num_experts_per_tok", 0) if family == "mixtral" else 0,
        router_aux_loss=float(raw.get("router_aux_loss_coef", 0.0)),
        sliding_window=sliding,
        layer_types=types,
        local_rope=local_rope,
        activation=ACTIVATIONS[act],
        gemma=gemma,
        query_scale=float(scalar) ** -0.5 if scalar else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        max_positions=raw.get("max_position_embeddings"),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        raw=raw,
    )
