"""Compute precision: the names a run takes, the dtype each computes in, and what a device
computes best in (bfloat16 where it has bfloat16 matrix units)."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from shardplug.errors import ConfigError

Precision = Literal["float32", "fp32", "bfloat16", "bf16"]

PRECISIONS = {"float32": None, "fp32": None, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def auto_precision(device: Any, asked: str = "auto") -> tuple[str, str]:
    """``(precision, why)``: ``asked``, or for ``"auto"`` what ``device`` computes best in:
    ``"bf16"`` (bfloat16 compute, float32 parameters and optimizer state) where it has
    bfloat16 matrix units (a TPU; an NVIDIA GPU of compute capability 8.0 or more: A100,
    H100 and later), else ``"float32"``."""
    if asked != "auto":
        return asked, "as asked"
    platform = getattr(device, "platform", "cpu")
    if platform == "tpu":
        return "bf16", "a TPU's bfloat16 matrix units"
    if platform == "gpu":
        capability = str(getattr(device, "compute_capability", "") or "")
        try:
            major = int(capability.split(".")[0])
        except ValueError:
            major = 0
        kind = getattr(device, "device_kind", "GPU")
        if major >= 8:
            return "bf16", f"the {kind}'s bfloat16 tensor cores"
        return "float32", f"the {kind} has no bfloat16 tensor cores"
    return "float32", f"a {platform.upper()} has no bfloat16 matrix units"


def compute_dtype(precision: str) -> Any:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Every float32 array of ``tree`` as ``dtype``; other arrays (integers, keys) as they are."""

    def cast(x):
        if hasattr(x, "dtype") and x.dtype == jnp.float32:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
