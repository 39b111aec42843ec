"""The supported pretrained families, one module each, and the reading of a checkpoint's
``config.json`` into the decoder's :class:`~shardplug.pretrained.config.DecoderConfig` by its
family.

A family's module gives ``FAMILY``, a :class:`~shardplug.pretrained.families.base.Family`:
its ``model_type``, the fields of its config it reads its own way, where each parameter lies in
its checkpoints (fused tensors included) and its decoder's traits. A new family is one module
here, listed in :data:`MODULES`, and its fixture (``scripts/hf_fixtures.py``).
"""

from __future__ import annotations

import json
import pathlib

from shardplug.errors import PretrainedError
from shardplug.pretrained.config import DecoderConfig, read_fields
from shardplug.pretrained.families import gemma3, llama, mistral, mixtral, phi3, qwen2, qwen3
from shardplug.pretrained.families.base import Family, Tensors

MODULES = (llama, mistral, qwen2, qwen3, gemma3, mixtral, phi3)
#: ``model_type`` -> its family
FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in MODULES}


def tensors(c: DecoderConfig) -> Tensors:
    """Where each of the decoder's parameters lies in the family's checkpoints."""
    return FAMILIES[c.family].tensors(c)


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
    if not isinstance(raw, dict):
        raise PretrainedError(f"{path}: a {type(raw).__name__}, not a model's config (an object)")
    family = FAMILIES.get(raw.get("model_type"))
    if family is None:
        named = raw.get("model_type") or ", ".join(raw.get("architectures") or []) or "none given"
        raise PretrainedError(
            f"{where}: architecture {named!r} is not supported; supported: "
            + ", ".join(f"{k} ({f.title})" for k, f in FAMILIES.items())
        )
    return read_fields(raw, where, family=family.model_type, traits=family.traits,
                       activation=family.activation, own=family.fields(raw, where))  # fmt: skip
