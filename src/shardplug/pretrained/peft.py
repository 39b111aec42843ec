"""Low-rank adapters in PEFT's format, as PEFT's ``save_pretrained`` writes them
(``adapter_config.json`` and ``adapter_model.safetensors``): read into
:mod:`shardplug.finetuning.lora`'s
factors (``train --lora-from DIR``) and a run's adapters written back (``export --format
peft``), so PEFT and transformers load them.

PEFT names each adapter by its module and layer and keeps ``lora_A`` (rank, in) and
``lora_B`` (out, rank): ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``.
A family's matrix stored transposed (a torch ``Linear``'s ``(out, in)``; the decoder's
``(in, out)``, stacked over layers) has ``L = A^T`` and ``R = B^T`` per layer. A parameter
kept in a fused tensor (Phi-3's ``qkv_proj``) or one per expert has no PEFT form of its own
here: refused in one line.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import numpy as np

from shardplug.errors import PretrainedError
from shardplug.pretrained.config import DecoderConfig
from shardplug.pretrained.families import tensors

PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: what a PEFT LoRA config may say that shardplug's adapters do not do
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
               "bias": "none", "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip


def modules(c: DecoderConfig) -> dict[str, str]:
    """Each decoder parameter with a PEFT form (``layers/q``) -> its module's name, ``{i}`` the
    layer (``model.layers.{i}.self_attn.q_proj``)."""
    table = tensors(c)
    shared: dict[str, int] = {}
    for stored in table.values():
        shared[stored.tensor] = shared.get(stored.tensor, 0) + 1
    return {
        name: stored.tensor.removesuffix(".weight")
        for name, stored in table.items()
        if name.startswith("layers/") and stored.transposed and "{e}" not in stored.tensor
        and shared[stored.tensor] == 1 and stored.tensor.endswith(".weight")
    }  # fmt: skip


def read(directory: str | pathlib.Path, c: DecoderConfig) -> tuple[int, float, dict[str, Any]]:
    """``(rank, alpha, factors)`` of the PEFT adapters in ``directory``: ``factors`` maps each
    decoder parameter (``layers/q``) to its ``(L, R)``, stacked over the layers."""
    from shardplug.pretrained.safetensors import Tensors

    directory = pathlib.Path(directory)
    where, config = directory / CONFIG, _config(directory)
    if config.get("peft_type") != "LORA":
        raise PretrainedError(f"{where}: peft_type {config.get('peft_type')!r}, not LORA")
    for key, plain in UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None):
            raise PretrainedError(
                f"{where}: {key} {config[key]!r}; shardplug's adapters are plain LoRA "
                f"({key} {plain!r})"
            )
    rank, alpha = settings(directory)
    files = Tensors(directory)
    names = set(files.names())
    factors = {}
    for name, module in modules(c).items():
        per_layer = [PREFIX + module.format(i=i) for i in range(c.layers)]
        found = [f"{m}.lora_A.weight" in names for m in per_layer]
        if not any(found):
            continue
        if not all(found):
            raise PretrainedError(
                f"{directory}: adapters on {module.format(i='N')} for some layers only "
                f"({sum(found)} of {c.layers}); shardplug's adapt every layer of a target"
            )
        a = [files.read(f"{m}.lora_A.weight") for m in per_layer]
        b = [files.read(f"{m}.lora_B.weight") for m in per_layer]
        names -= {f"{m}.lora_{x}.weight" for m in per_layer for x in "AB"}
        factors[name] = (np.stack([x.T for x in a]), np.stack([x.T for x in b]))
    if names:
        raise PretrainedError(
            f"{directory}: {len(names)} tensors fit no {c.family} parameter this family maps, "
            f"e.g. {sorted(names)[0]}"
        )
    if not factors:
        raise PretrainedError(f"{directory}: no adapters in {WEIGHTS}")
    return rank, alpha, factors


def write(directory: str | pathlib.Path, c: DecoderConfig, factors: dict[str, Any],
          rank: int, alpha: float, base: str, dropout: float = 0.0) -> None:  # fmt: skip
    """Write ``factors`` (decoder parameter -> ``(L, R)``) as PEFT's adapters for the model at
    ``base``; refuses a directory that exists."""
    from shardplug.pretrained.safetensors import write as write_tensors

    directory = pathlib.Path(directory)
    if directory.exists():
        raise PretrainedError(f"{directory} already exists: choose another directory")
    table = modules(c)
    missing = [name for name in factors if name not in table]
    if missing:
        raise PretrainedError(
            f"{missing[0]} of {c.family} has no PEFT form of its own (a fused or per-expert "
            f"tensor): export --format hf --merge writes the adapters merged instead"
        )
    entries = []
    for name, (left, right) in sorted(factors.items()):
        for i in range(c.layers):
            module = PREFIX + table[name].format(i=i)
            for part, array in (("A", left[i].T), ("B", right[i].T)):
                entries.append((f"{module}.lora_{part}.weight", array.shape, np.dtype(array.dtype),
                                lambda array=array: array))  # fmt: skip
    targets = sorted({table[name].rsplit(".", 1)[1] for name in factors})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": targets, "lora_dropout": dropout, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip
    directory.mkdir(parents=True)
    write_tensors(directory / WEIGHTS, entries)
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def _config(directory: str | pathlib.Path) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` in ``directory``; one line where there is none."""
    where = pathlib.Path(directory) / CONFIG
    if not where.is_file():
        raise PretrainedError(f"--lora-from {directory}: no {CONFIG} there (PEFT's adapters)")
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise PretrainedError(f"--lora-from {where}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise PretrainedError(f"--lora-from {where}: a {type(config).__name__}, not PEFT's "
                              "adapter config (an object)")  # fmt: skip
    return config


def settings(directory: str | pathlib.Path) -> tuple[int, float]:
    """``(rank, alpha)`` of PEFT's adapters in ``directory``, from their config."""
    config = _config(directory)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise PretrainedError(f"--lora-from {directory}: {CONFIG}'s r is {rank!r}; PEFT's "
                              "rank is a positive integer")  # fmt: skip
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise PretrainedError(f"--lora-from {directory}: {CONFIG}'s lora_alpha is {alpha!r}; "
                              "it takes a number")  # fmt: skip
    return rank, float(alpha)


def dropout(directory: str | pathlib.Path) -> float:
    """PEFT's ``lora_dropout`` of the adapters in ``directory`` (0 where their config has
    none); one line where it is no probability."""
    value = _config(directory).get("lora_dropout", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise PretrainedError(f"--lora-from {directory}: {CONFIG}'s lora_dropout is {value!r}; "
                              "it takes a probability in [0, 1)")  # fmt: skip
    return float(value)


def of_run(run: dict[str, Any]) -> tuple[int, float] | None:
    """``(rank, alpha)`` of the adapters a run recorded in its checkpoints' config (``--lora``
    or ``--lora-from``'s), or None for a run without."""
    if run.get("lora_from_rank"):
        return int(run["lora_from_rank"]), float(run["lora_from_alpha"])
    if run.get("lora_from"):
        return settings(run["lora_from"])
    if run.get("lora"):
        return int(run["lora"]), float(run.get("lora_alpha") or run["lora"])
    return None


def targets_pattern(paths: list[str]) -> str:
    """A ``--lora-targets`` pattern that matches exactly ``paths``."""
    return "^(" + "|".join(re.escape(p) for p in paths) + ")$"
