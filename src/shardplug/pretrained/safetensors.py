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
INDEX = "model.safetensors.index.json"


def _header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PretrainedError(f"{path}: not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise PretrainedError(f"{path}: not a safetensors file (no JSON header)") from None
    header.pop("__metadata__", None)
    return header, 8 + size


class Tensors:
    """The tensors of a checkpoint directory: one ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names, or every ``*.safetensors`` there."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.bytes_read = 0
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
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
        code = self._entries[name][1]["dtype"]
        if code not in DTYPES:
            raise PretrainedError(f"{name}: dtype {code} is not one shardplug reads")
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
            array = np.ascontiguousarray(produce(), dtype=dtype)
            if array.shape != tuple(shape):
                raise PretrainedError(f"{name}: produced {array.shape}, declared {tuple(shape)}")
            f.write(array.tobytes())
    return offset
