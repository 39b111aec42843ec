"""Safetensors files read a slice at a time, and written a tensor at a time.

The format is 8 bytes of header length, a JSON header (each tensor's dtype, shape and byte
range) and the tensors' bytes, row-major. A file is mapped, not read: a slice copies only
the bytes it covers (a device's block of rows is one contiguous range), so a process reads
what its devices hold and no more. :attr:`Tensors.bytes_read` counts them.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

from shardplug.errors import PretrainedError

DTYPES = {
    "F64": np.dtype("float64"), "F32": np.dtype("float32"), "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("int64"), "I32": np.dtype("int32"),
    "I16": np.dtype("int16"), "I8": np.dtype("int8"), "U8": np.dtype("uint8"),
    "BOOL": np.dtype("bool"), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}  # fmt: skip
NAMES = {dtype: name for name, dtype in DTYPES.items()}
#: the bits of an element of each dtype safetensors names (those shardplug reads and others)
BITS = {**{name: dtype.itemsize * 8 for name, dtype in DTYPES.items()}, "U16": 16, "U32": 32,
        "U64": 64, "C64": 64, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}  # fmt: skip
_FLOATS = frozenset(DTYPES[k] for k in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"))
INDEX = "model.safetensors.index.json"


#: the longest header shardplug reads (safetensors' own limit)
MAX_HEADER = 100_000_000


def _header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's tensors (name: dtype, shape, byte range) and where their bytes
    start, checked by the format's rules before a byte of them is used: a header that is a
    JSON object of entries, each a known dtype, a shape of counts and a range as long as
    shape times dtype, the ranges in order, one after the other, covering the data exactly."""
    damaged = f"{path}: a damaged safetensors file ({{}}); download or copy it again"
    try:
        total = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PretrainedError(f"{path}: not a safetensors file (shorter than a header)")
            (size,) = struct.unpack("<Q", head)
            if size > min(MAX_HEADER, total - 8):
                why = f"its header says it is {size} bytes long, the file has {total - 8}"
                raise PretrainedError(damaged.format(why))
            text = f.read(size)
    except OSError as exc:
        raise PretrainedError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise PretrainedError(f"{path}: not a safetensors file (no JSON header)") from None
    if not isinstance(header, dict):
        raise PretrainedError(damaged.format(f"its header is a {type(header).__name__}, not an "
                                             "object of tensors"))  # fmt: skip
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        spans.append((_span(name, entry, damaged, path), name))
    end = 0
    for (begin, stop), name in sorted(spans):
        if begin != end:
            why = "it overlaps the one before" if begin < end else "a gap before it"
            raise PretrainedError(damaged.format(f"{name!r} starts at byte {begin}: {why}"))
        end = stop
    if end != total - 8 - size:
        why = f"its tensors cover {end} bytes of data, the file holds {total - 8 - size}"
        raise PretrainedError(damaged.format(why))
    return header, 8 + size


def _span(name: str, entry: Any, damaged: str, path: pathlib.Path) -> tuple[int, int]:
    """A header entry's byte range, checked against its dtype and shape."""

    def counts(value: Any, length: int | None = None) -> bool:
        return (isinstance(value, list) and (length is None or len(value) == length)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in value))  # fmt: skip

    if not isinstance(entry, dict):
        raise PretrainedError(damaged.format(f"{name!r} is a {type(entry).__name__}, not an "
                                             "entry of dtype, shape and data_offsets"))  # fmt: skip
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise PretrainedError(damaged.format(f"{name!r} has no dtype"))
    if not counts(shape):
        raise PretrainedError(damaged.format(f"{name!r} has shape {shape!r}"))
    if not counts(offsets, 2) or offsets[0] > offsets[1]:
        raise PretrainedError(damaged.format(f"{name!r} has data_offsets {offsets!r}"))
    bits = BITS.get(dtype)  # a dtype shardplug does not read is refused when read, not here
    want = -(-int(np.prod(shape, dtype=object)) * bits // 8) if bits else offsets[1] - offsets[0]
    if offsets[1] - offsets[0] != want:
        raise PretrainedError(damaged.format(
            f"{name!r} spans {offsets[1] - offsets[0]} bytes; its shape {shape} of {dtype} "
            f"takes {want}"))  # fmt: skip
    return offsets[0], offsets[1]


def _shards(index: pathlib.Path) -> list[str]:
    """The shard files an index's ``weight_map`` names."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and f and "/" not in f for f in weight_map.values()
    ):
        raise PretrainedError(f"{index}: not a safetensors index (a weight_map of tensor "
                              "names to shard files in this folder); copy it again")  # fmt: skip
    return sorted(set(weight_map.values()))


class Tensors:
    """The tensors of a checkpoint directory: one ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names, or every ``*.safetensors`` there."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.bytes_read = 0
        index = self.directory / INDEX
        if index.is_file():
            files = _shards(index)
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise PretrainedError(f"{self.directory}: no *.safetensors files there")
        self._entries: dict[str, tuple[pathlib.Path, dict[str, Any], int]] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise PretrainedError(
                    f"{path}: a shard {INDEX} names is missing; copy the whole checkpoint"
                )
            header, start = _header(path)
            for tensor, entry in header.items():
                self._entries[tensor] = (path, entry, start)
        self._maps: dict[pathlib.Path, np.memmap] = {}

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor in the files."""
        return sum(
            e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in self._entries.values()
        )

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def dtype(self, name: str) -> np.dtype:
        path, entry, _ = self._entries[name]
        code = entry["dtype"]
        if code not in DTYPES:
            raise PretrainedError(f"{path}: {name}: dtype {code} is not one shardplug reads "
                                  f"({', '.join(DTYPES)})")  # fmt: skip
        return DTYPES[code]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file (nothing is read yet)."""
        path, entry, start = self._entries[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        flat = self._maps[path][start + begin : start + end]
        return flat.view(self.dtype(name)).reshape(entry["shape"])

    def read(self, name: str, index: Any = ()) -> np.ndarray:
        """A copy of ``tensor[index]``; only its bytes are read, and counted. The file is
        mapped for this read alone, so its pages leave the process once copied."""
        path, entry, start = self._entries[name]
        offset = start + entry["data_offsets"][0]
        mapped = np.memmap(path, self.dtype(name), "r", offset=offset, shape=tuple(entry["shape"]))
        out = np.array(mapped[index])
        del mapped
        self.bytes_read += out.nbytes
        if out.dtype in _FLOATS and not np.isfinite(out).all():  # found here, not at step 0
            bad = int(out.size - np.isfinite(out).sum())
            raise PretrainedError(f"{path}: tensor {name} holds {bad} NaN or infinite values: "
                                  "the checkpoint is damaged; copy it again")  # fmt: skip
        return out


def write(
    path: str | pathlib.Path,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
) -> int:
    """Write a safetensors file, one tensor in memory at a time: ``tensors`` gives each
    one's name, shape, dtype and a function that returns its array, called in that order
    (the data lies in that order; the header lists the names sorted). Returns bytes written."""
    tensors = list(tensors)
    entries: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype, _ in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        entries[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header.update(sorted(entries.items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with pathlib.Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype, produce in tensors:
            array = np.asarray(produce(), dtype=dtype)  # a scalar stays one (shape ())
            array = np.ascontiguousarray(array) if array.ndim else array
            if array.shape != tuple(shape):
                raise PretrainedError(f"{name}: produced {array.shape}, declared {tuple(shape)}")
            f.write(array.tobytes())
    return offset
