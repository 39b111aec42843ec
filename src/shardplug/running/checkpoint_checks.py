"""What a checkpoint is checked with: each array's fingerprint (computed on the devices that
hold it, the same under any sharding), its files' readability (trouble that is not damage),
its directory's writability, and its arrays against the state it restores into."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplug.errors import CheckpointError, ConfigError


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 words (one per element, two for 64-bit types)."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits < 32:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """A position-weighted sum of the bits, mod 2**32: the same under any sharding (integer
    addition is associative), and changed by any change to a single element."""
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim) * np.uint32(
            stride % 2**32
        )
        stride *= words.shape[dim]
    weight = (index * np.uint32(0x9E3779B1) + np.uint32(0x7F4A7C15)) | np.uint32(1)
    return jnp.sum(words * weight, dtype=jnp.uint32)


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_fingerprint(jax.device_put(x, jax.memory.Space.Device)) for x in leaves]


def fingerprints(leaves: Sequence[jax.Array]) -> list[int]:
    """One 32-bit fingerprint per array, computed on the devices that hold it (an array kept
    in host memory, offload's, copied to them)."""
    return [int(f) for f in jax.device_get(_fingerprints(list(leaves)))]


def readable(root: Path) -> None:
    """Raise :class:`CheckpointError` naming the first file or folder of a checkpoint that
    cannot be read for a reason other than damage (permission denied, an I/O error).

    Such a checkpoint is not damaged: setting it aside and resuming from an older one would
    roll the run back in silence. Missing or corrupt files are left to the fingerprints.
    """
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            if path.is_dir():
                stack.extend(sorted(path.iterdir()))
            else:
                _read_one(path)
        except FileNotFoundError:
            continue  # gone: damage, which the restore itself reports
        except OSError as exc:
            raise CheckpointError(
                f"cannot read {path}: {exc.strerror or exc}; the checkpoint was left as it is "
                "(not damaged, unreadable): fix the file's permissions or the disk, and resume"
            ) from None


def _read_one(path: Path) -> None:
    with open(path, "rb") as file:
        file.read(1)


class _Damaged(Exception):
    pass


def _reason(exc: BaseException) -> str:
    """Why the arrays could not be read, in words (TensorStore's text runs on into the repr
    of a bound method)."""
    text = " ".join(str(exc).split())
    if any(k in text for k in ("reading array index", "TensorStore", "OCDBT", '"zarr"')):
        return "a data file under its state/ folder is damaged or missing"
    text = re.sub(r"\s*See full TensorStore details:.*", "", text)
    text = re.sub(r"<bound method [^>]*>?", "", text).strip()
    return f"{type(exc).__name__}: {text[:200]}"


def _check_writable(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint directory {directory} is a file: name a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a unique name: every process of a multi-host job probes the same directory
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".shardplug-write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"checkpoint directory {directory} is not writable ({exc.strerror or exc}): "
            f"choose another --checkpoint-dir"
        ) from None


def _check_frozen(path: Path, frozen: Mapping[str, int], live: Mapping[str, Any]) -> None:
    """A checkpoint that holds adapters alone restores only onto the base they were trained
    on: the frozen arrays of the state given, fingerprinted as the run saved them."""
    missing = [n for n in frozen if n not in live]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} is of a different model: its frozen {missing[0]} is not in it"
        )
    if not all(isinstance(live[n], jax.Array) for n in frozen):
        raise CheckpointError(
            f"checkpoint {path} holds adapters without their frozen base: restore it into a "
            "trainer that holds the base (allocated)"
        )
    found = fingerprints([live[n] for n in frozen])
    wrong = [n for n, f in zip(frozen, found, strict=True) if frozen[n] != f]
    if wrong:
        raise CheckpointError(
            f"checkpoint {path} holds adapters trained on another base: {len(wrong)} of its "
            f"{len(frozen)} frozen arrays differ ({', '.join(wrong[:3])}"
            f"{', ...' if len(wrong) > 3 else ''}); resume on the base it was trained on"
        )


def _check_same_arrays(path: Path, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """A checkpoint of another model or optimizer is an error naming what differs."""
    missing = [n for n in expected if n not in saved]
    extra = [n for n in saved if n not in expected]
    reshaped = [
        f"{n} {tuple(saved[n]['shape'])} {saved[n]['dtype']} vs "
        f"{tuple(expected[n]['shape'])} {expected[n]['dtype']}"
        for n in expected
        if n in saved
        and (saved[n]["shape"] != expected[n]["shape"] or saved[n]["dtype"] != expected[n]["dtype"])
    ]
    if not (missing or extra or reshaped):
        return
    parts = []
    for label, items in (
        ("not in the checkpoint", missing),
        ("only in the checkpoint", extra),
        ("different shape or dtype", reshaped),
    ):
        if items:
            shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
            parts.append(f"{label}: {shown}")
    raise CheckpointError(
        f"checkpoint {path} is of a different model or optimizer; {'; '.join(parts)}"
    )
