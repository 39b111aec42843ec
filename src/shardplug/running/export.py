"""Exporting a checkpoint's weights for inference, and loading them back into a model.

The file is a NumPy ``.npz``: one entry per parameter (``params/<path>``) and per array of
model state (``model_state/<path>``, e.g. BatchNorm's running statistics), whole (gathered
from every device's shards), plus ``__shardplug__``: JSON with the step, the configuration
and each entry's dtype. bfloat16 is stored as its uint16 bits and restored on load. Loading
never unpickles (``allow_pickle=False``), so a file from elsewhere cannot run code.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplug.errors import CheckpointError, ConfigError

INFO = "__shardplug__"
SECTIONS = ("params/", "model_state/")


def export_checkpoint(
    checkpoint_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None
) -> Path:
    """Write the weights of checkpoint ``step`` (the newest for None) to ``out`` (``.npz``).

    Refuses to overwrite an existing file; writes to a temporary file and renames it, so a
    failure leaves nothing half-written.
    """
    from shardplug.running.checkpoint import Checkpoints

    out = Path(out)
    if out.suffix != ".npz":
        raise ConfigError(f"export file {out} must end in .npz")
    if out.exists():
        raise ConfigError(f"{out} already exists: choose another file or remove it first")
    checkpoints = Checkpoints(checkpoint_dir, read_only=True)
    if checkpoints.read_meta_of(step)[1].get("frozen"):
        raise ConfigError(
            f"{checkpoint_dir}: its checkpoints hold low-rank adapters without their frozen "
            "base: export --format peft writes the adapters; a pretrained run's whole model, "
            "export --format hf --merge"
        )
    step, arrays, meta = checkpoints.read_arrays(step)
    entries: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, value in arrays.items():
        if not name.startswith(SECTIONS):
            continue
        dtypes[name] = str(value.dtype)
        entries[name] = value.view(np.uint16) if value.dtype == jnp.bfloat16 else value
    info = {"step": step, "config": meta.get("config", {}), "dtypes": dtypes}
    entries[INFO] = np.array(json.dumps(info))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".npz.partial", delete=False) as f:
        partial = Path(f.name)
    try:
        with open(partial, "wb") as file:  # a file object: savez would append ".npz"
            np.savez(file, **entries)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def load_exported(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An exported file's arrays by name (``params/...``, ``model_state/...``) and its info."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            info = json.loads(str(data[INFO]))
            arrays = {name: data[name] for name in data.files if name != INFO}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"{path} is not a shardplug export ({type(exc).__name__}: {exc})"
        ) from None
    for name, dtype in info.get("dtypes", {}).items():
        if dtype == "bfloat16" and name in arrays:
            arrays[name] = arrays[name].view(jnp.bfloat16)
    return arrays, info


def load_model(path: str | os.PathLike, adapter: Any) -> Any:
    """The adapter's model holding the exported weights, in its framework's own form and in
    evaluation mode: an NNX module, a Linen module bound to its variables, an Equinox module;
    an Equinox model with state comes back as ``(model, state)``, as
    ``eqx.nn.make_with_state`` gives it.

    Every parameter and every floating-point array of model state must be in the file with
    the model's shape; :class:`CheckpointError` names those that are not.
    """
    from shardplug.core.sharding import leaf_paths

    arrays, _ = load_exported(path)
    key = jax.random.key(0)
    params, state = adapter.variables if adapter.variables is not None else adapter.init(key)

    def fill(tree: Any, prefix: str, required: Any) -> Any:
        names = leaf_paths(tree)
        leaves, treedef = jax.tree.flatten(tree)
        missing, reshaped, out = [], [], []
        for name, leaf in zip(names, leaves, strict=True):
            full = prefix + name
            if full not in arrays:
                if required(leaf):
                    missing.append(full)
                out.append(leaf)
            elif np.shape(arrays[full]) != np.shape(leaf):
                reshaped.append(f"{full} {np.shape(arrays[full])} vs {np.shape(leaf)}")
            else:
                out.append(jnp.asarray(arrays[full], dtype=leaf.dtype))
        if missing or reshaped:
            raise CheckpointError(
                f"{path} does not fit this model: "
                + "; ".join(
                    f"{label}: {', '.join(items[:4])}" + (" ..." if len(items) > 4 else "")
                    for label, items in (("missing", missing), ("different shape", reshaped))
                    if items
                )
            )
        return jax.tree.unflatten(treedef, out)

    def is_float(leaf: Any) -> bool:
        return jnp.issubdtype(leaf.dtype, jnp.floating)

    params = fill(params, "params/", lambda leaf: True)
    state = fill(state, "model_state/", is_float)
    model = adapter.bind(params, state, rng=key, train=False)
    if getattr(adapter, "framework", None) == "equinox" and state is not None:
        return model, state
    return model


__all__ = ["export_checkpoint", "load_exported", "load_model"]
