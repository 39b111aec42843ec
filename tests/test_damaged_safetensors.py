"""A damaged safetensors file is refused in one line naming the file, before a byte of its
tensors is used: never a crash, never other weights loaded in silence (two tensors whose
ranges overlapped loaded and trained, exit 0). A fuzzer of headers, truncations and ranges."""

import json
import random
import struct

import numpy as np
import pytest

from shardplug.errors import PretrainedError
from shardplug.pretrained.safetensors import Tensors, write

ARRAYS = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(6, dtype=np.int32),
    "c": np.ones((2, 2), np.float16),
}


def _intact(folder):
    path = folder / "model.safetensors"
    write(path, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in ARRAYS.items()])
    return path


def _parts(path):
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _rewrite(path, header, data, length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _loaded(folder):
    tensors = Tensors(folder)
    return {n: tensors.read(n) for n in tensors.names()}


def test_an_intact_file_loads_exactly(tmp_path):
    _intact(tmp_path)
    got = _loaded(tmp_path)
    assert got.keys() == ARRAYS.keys()
    for name, array in ARRAYS.items():
        np.testing.assert_array_equal(got[name], array)


def _damage(header, data):
    """Each kind of damage: (what it is, the header, the data, a header length or None)."""
    a, b = header["a"]["data_offsets"], header["b"]["data_offsets"]
    overlapping = json.loads(json.dumps(header))
    overlapping["b"]["data_offsets"] = [a[0], a[0] + (b[1] - b[0])]  # b reads a's bytes
    short = json.loads(json.dumps(header))
    short["c"]["dtype"] = "U8"
    short["c"]["shape"] = [short["c"]["data_offsets"][1] - short["c"]["data_offsets"][0] - 2]
    short["c"]["data_offsets"][1] -= 2  # covers less than the file
    wrong_dtype = json.loads(json.dumps(header))
    wrong_dtype["a"]["dtype"] = "F16"  # half the bytes its range holds
    yield "overlapping ranges", overlapping, data, None
    yield "a range short of the data", short, data, None
    yield "a dtype whose size is not the range's", wrong_dtype, data, None
    yield "a truncated file", header, data[:-5], None
    yield "a header that is a list", list(header), data, None
    yield "an entry that is a string", {**header, "a": "F32"}, data, None
    yield "a header length past the file", header, data, 10**12
    yield "a huge header length", header, data, 2**63
    yield "a negative dimension", {**header, "a": {**header["a"], "shape": [-3, -4]}}, data, None
    yield "offsets out of order", {**header, "a": {**header["a"], "data_offsets": a[::-1]}}, data, None  # noqa: E501
    yield "offsets of bools", {**header, "a": {**header["a"], "data_offsets": [True, 48]}}, data, None  # noqa: E501
    yield "an unknown dtype", {**header, "a": {**header["a"], "dtype": "F128"}}, data, None


@pytest.mark.parametrize("case", range(12))
def test_each_kind_of_damage_is_one_line_naming_the_file(tmp_path, case):
    path = _intact(tmp_path)
    what, header, data, length = list(_damage(*_parts(path)))[case]
    _rewrite(path, header, data, length)
    with pytest.raises(PretrainedError) as caught:
        _loaded(tmp_path)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message, (what, message)


def test_garbage_and_random_damage_never_crash_nor_load_other_bytes(tmp_path):
    """Random bytes in the header, random truncations, random edits of the header's numbers:
    each file is refused with a PretrainedError, or loads the intact arrays exactly."""
    path = _intact(tmp_path)
    raw = path.read_bytes()
    header, data = _parts(path)
    rng = random.Random(0)
    refused = 0
    for trial in range(300):
        kind = trial % 3
        if kind == 0:  # bytes of the header flipped (the data's bytes have no checksum)
            damaged = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(raw) - len(data))] = rng.randrange(256)
            path.write_bytes(bytes(damaged))
        elif kind == 1:  # cut short, or garbage after
            cut = rng.randrange(len(raw) + 8)
            path.write_bytes(raw[:cut] if cut < len(raw) else raw + bytes(cut - len(raw) + 1))
        else:  # one number of the header changed
            edited = json.loads(json.dumps(header))
            name = rng.choice(list(ARRAYS))
            field = rng.choice(["shape", "data_offsets"])
            values = edited[name][field]
            values[rng.randrange(len(values))] += rng.choice([-8, -2, -1, 1, 2, 8])
            _rewrite(path, edited, data)
        try:
            got = _loaded(tmp_path)
        except PretrainedError as exc:
            assert "\n" not in str(exc)
            refused += 1
            continue
        # loaded: then exactly the arrays written (a flipped letter of a name renames one,
        # which the model's load then finds missing)
        def arrays(named):
            return sorted((a.dtype.str, a.shape, a.tobytes()) for a in named.values())

        assert arrays(got) == arrays(ARRAYS)
    assert refused > 200, refused  # nearly every damage is one


def test_a_broken_index_is_one_line(tmp_path):
    _intact(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    for text in ("[1, 2]", "{", '{"weight_map": {"a": 3}}', '{"weight_map": {"a": "../x"}}'):
        index.write_text(text)
        with pytest.raises(PretrainedError, match="not a safetensors index"):
            Tensors(tmp_path)


def test_a_tensor_holding_nan_is_refused_when_read_naming_it(tmp_path):
    """Not at step 0 as a loss that is not finite, with advice about the learning rate."""
    path = tmp_path / "model.safetensors"
    bad = np.array([1.0, np.nan, np.inf], np.float32)
    write(path, [("w", bad.shape, bad.dtype, lambda: bad)])
    with pytest.raises(PretrainedError, match=r"tensor w holds 2 NaN or infinite values"):
        Tensors(tmp_path).read("w")


def test_valid_files_the_reader_does_not_read_every_dtype_of_still_load(tmp_path):
    """A zero-size tensor, a scalar and a dtype shardplug does not read (U32) are valid: the
    file loads, and only reading the U32 tensor is refused."""
    path = tmp_path / "model.safetensors"
    arrays = {"empty": np.zeros((0, 4), np.float32), "scalar": np.array(3.0, np.float32)}
    write(path, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in arrays.items()])
    header, data = _parts(path)
    header["ids"] = {"dtype": "U32", "shape": [2],
                     "data_offsets": [len(data), len(data) + 8]}  # fmt: skip
    _rewrite(path, header, data + np.arange(2, dtype=np.uint32).tobytes())
    tensors = Tensors(tmp_path)
    assert tensors.read("empty").shape == (0, 4) and tensors.read("scalar") == 3.0
    with pytest.raises(PretrainedError, match="ids: dtype U32 is not one shardplug reads"):
        tensors.read("ids")


def test_a_deeply_nested_header_is_one_line(tmp_path):
    path = _intact(tmp_path)
    text = b"[" * 100_000
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(PretrainedError, match="no JSON header"):
        Tensors(tmp_path)
