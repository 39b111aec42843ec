"""What a pretrained family is: the record each family's module beside this one gives
(:class:`Family`), and where each of the decoder's parameters lies in the family's
checkpoints (:class:`Stored`).

A family's tensors name every parameter's stored tensor; a stored tensor can hold several
parameters (a fused tensor: Phi-3's ``qkv_proj`` holds q, k and v one after another along its
first axis), each parameter then its rows from ``offset``. Loading reads each parameter's
rows; export writes the fused tensor back whole, its parameters in their order.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

from shardplug.pretrained.config import DecoderConfig, Traits


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one parameter lies in a checkpoint."""

    #: the tensor's name; ``{i}`` the layer, ``{e}`` the expert (one tensor each)
    tensor: str
    #: stored transposed (a torch ``Linear`` is (out, in); the decoder's matrices (in, out))
    transposed: bool = False
    #: in a fused tensor, the first index of the parameter's rows along the stored first axis
    offset: int = 0


#: a family's parameter names (``embed``, ``layers/q``) -> where each is stored
Tensors = dict[str, Stored]


def standard(c: DecoderConfig) -> Tensors:
    """Llama's tensor names, which most families keep: one tensor per parameter."""
    a, layer = "model.layers.{i}.self_attn.", "model.layers.{i}."
    names = {
        "embed": Stored("model.embed_tokens.weight"),
        "norm": Stored("model.norm.weight"),
        "head": Stored("lm_head.weight", transposed=True),
        "layers/attention_norm": Stored(layer + "input_layernorm.weight"),
        "layers/mlp_norm": Stored(layer + "post_attention_layernorm.weight"),
    }
    for n in "qkvo":
        names[f"layers/{n}"] = Stored(f"{a}{n}_proj.weight", transposed=True)
    for n in "qkv":
        names[f"layers/{n}_bias"] = Stored(f"{a}{n}_proj.bias")
    for n in "qk":
        names[f"layers/{n}_norm"] = Stored(f"{a}{n}_norm.weight")
    for n in ("gate", "up", "down"):
        names[f"layers/{n}"] = Stored(f"{layer}mlp.{n}_proj.weight", transposed=True)
    return names


def _no_fields(raw: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """A pretrained family, as its module of :mod:`shardplug.pretrained.families` gives it."""

    #: ``config.json``'s ``model_type``
    model_type: str
    #: the family's name in messages
    title: str
    #: each parameter's stored tensor (:class:`Stored`), for a config of the family
    tensors: Callable[[DecoderConfig], Tensors] = standard
    #: what the decoder does for this family that no config states
    traits: Traits = dataclasses.field(default_factory=Traits)
    #: the :class:`DecoderConfig` fields the family reads its own way, from ``config.json``
    #: (``raw``); the rest are read alike for every family (``config.read_fields``)
    fields: Callable[[dict[str, Any], pathlib.Path], dict[str, Any]] = _no_fields
    #: the config's key for the activation, and the one activation the family builds
    activation: tuple[str, str] = ("hidden_act", "silu")
