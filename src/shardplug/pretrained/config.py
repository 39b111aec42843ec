"""A checkpoint's ``config.json``, read into the one decoder shardplug builds for every family.

Every supported family is one architecture with switches: RMSNorm before each sub-layer,
rotary positions, grouped-query attention, a gated MLP (or routed experts). What differs is
read from the config: biases on q/k/v, RMSNorm on each head's queries and keys, the output
tied to the embedding, the rotary frequencies' scaling (Llama 3.1's ``llama3``, ``linear``)
and the share of each head they turn (``partial_rotary_factor``), sliding-window attention
(with its own rotary base on the sliding layers), the experts, the activation, the query
scale and the logits' soft cap; and a family's :class:`Traits`, what no config states (Gemma's
norms scaling by ``1 + weight``, a norm after each sub-layer, the embedding scaled by the
square root of the width). Each family is a module of :mod:`shardplug.pretrained.families`,
which reads its own fields (its :class:`~shardplug.pretrained.families.base.Family`); the
fields every family reads alike are read here (:func:`read_fields`). Configs as
transformers 4.x wrote them (``rope_theta``, ``rope_scaling``) and as 5.x writes them
(``rope_parameters``) read the same.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

from shardplug.errors import PretrainedError

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # the config's name -> ours
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a family's decoder does that its config does not say (all off: Llama's)."""

    #: RMSNorm scales by ``1 + weight``, in float32 before the cast back (a fresh weight is 0)
    norm_plus_one: bool = False
    #: each sub-layer's output normed too before it joins the residual
    post_norms: bool = False
    #: the embedding multiplied by the square root of the width (rounded to its dtype first)
    embed_scale: bool = False


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
    traits: Traits = Traits()  # the family's, which no config states
    partial_rotary: float = 1.0  # the share of each head's dimensions the rotary turns
    query_scale: float | None = None  # the attention's scale, when not 1/sqrt(head_dim)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    max_positions: int | None = None
    dtype: str = "float32"  # as stored: config.json's ``torch_dtype`` / ``dtype``
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's leading dimensions the rotary turns."""
        return int(self.head_dim * self.partial_rotary)

    def inverse_frequencies(self, local: bool = False) -> list[float]:
        """Rotary frequencies of each pair of a head's dimensions, the scaling applied (of the
        sliding layers' rotary, with ``local``, where it differs)."""
        theta, rope = self.local_rope if local and self.local_rope else (self.rope_theta,
                                                                         self.rope)  # fmt: skip
        d = self.rotary_dim
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


def need(raw: dict, key: str, where: pathlib.Path) -> Any:
    """``raw[key]``, a count (a positive integer), or a one-line error naming the checkpoint."""
    if key not in raw:
        raise PretrainedError(f"{where}: config.json has no {key!r}, which a decoder needs")
    return count(raw, key, where)


def count(raw: dict, key: str, where: pathlib.Path) -> int | None:
    """``raw[key]`` where it is a positive integer, None where absent or null; else a
    one-line error (``"hidden_size": "64"`` is a string, not a count)."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PretrainedError(f"{where}: config.json's {key} is {value!r}; it takes a positive "
                              "integer")  # fmt: skip
    return value


def number(raw: dict, key: str, where: pathlib.Path, default: float) -> float:
    """``raw[key]`` as a float (``default`` where absent); else a one-line error."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PretrainedError(f"{where}: config.json's {key} is {value!r}; it takes a number")
    return float(value)


def rope(raw: dict, where: pathlib.Path, params: dict | None = None) -> tuple[float, dict]:
    """``(theta, scaling)`` from 5.x's ``rope_parameters`` (or ``params``, one layer type's)
    or 4.x's ``rope_theta`` and ``rope_scaling`` (whose type was once called ``type``)."""
    new, old = raw.get("rope_parameters"), raw.get("rope_scaling")
    for key, value in (("rope_parameters", new), ("rope_scaling", old)):
        if value is not None and not isinstance(value, dict):
            raise PretrainedError(f"{where}: config.json's {key} is {value!r}; it takes an "
                                  "object (rope_type, factor, ...)")  # fmt: skip
    if params is None and new and old:
        kinds = [v.get("rope_type", v.get("type", "default")) for v in (new, old)]
        if kinds[0] != kinds[1]:
            raise PretrainedError(f"{where}: config.json's rope_parameters ({kinds[0]}) and "
                                  f"rope_scaling ({kinds[1]}) disagree: keep the one the model "
                                  "was trained with")  # fmt: skip
    params = dict(params if params is not None else new or {})
    if not params:
        params = dict(old or {})
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


def read_fields(raw: dict, where: pathlib.Path, *, family: str, traits: Traits,
                activation: tuple[str, str], own: dict[str, Any]) -> DecoderConfig:  # fmt: skip
    """The :class:`DecoderConfig` of ``raw``: the fields every family reads alike, then the
    family's ``own`` (which win); ``activation`` is the key the family names its activation
    by and the one it builds (its default)."""
    key, built = activation
    act = raw.get(key, built)
    if act != built or act not in ACTIVATIONS:
        raise PretrainedError(f"{where}: activation {act!r} is not built for {family}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag) and not own.get("qkv_bias"):
            raise PretrainedError(f"{where}: {flag}: true is not built (only Qwen2's q/k/v biases)")
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(flag):
            raise PretrainedError(f"{where}: {flag} {raw[flag]!r} is not built")
    width, heads = need(raw, "hidden_size", where), need(raw, "num_attention_heads", where)
    fields: dict[str, Any] = dict(
        family=family,
        vocab=need(raw, "vocab_size", where),
        width=width,
        mlp=need(raw, "intermediate_size", where),
        layers=need(raw, "num_hidden_layers", where),
        heads=heads,
        kv_heads=count(raw, "num_key_value_heads", where) or heads,
        head_dim=count(raw, "head_dim", where) or width // heads,
        norm_eps=number(raw, "rms_norm_eps", where, 1e-6),
        tied=bool(raw.get("tie_word_embeddings", False)),
        router_aux_loss=number(raw, "router_aux_loss_coef", where, 0.0),
        sliding_window=count(raw, "sliding_window", where),
        activation=ACTIVATIONS[act],
        traits=traits,
        max_positions=count(raw, "max_position_embeddings", where),
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        raw=raw,
    )
    fields.update(own)
    if "rope_theta" not in own:
        fields["rope_theta"], fields["rope"] = rope(raw, where)
    layers = fields["layers"]
    kind = "sliding" if fields["sliding_window"] else "full"
    types = fields.setdefault("layer_types", (kind,) * layers)
    if len(types) != layers:
        raise PretrainedError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    return DecoderConfig(**fields)
