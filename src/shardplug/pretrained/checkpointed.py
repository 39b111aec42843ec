"""A training checkpoint's parameters read back for ``export --format hf`` (see
:func:`shardplug.pretrained.export_checkpoint`): each one read when its first piece is asked
for and let go after its last; a LoRA run's adapters merged in, a QLoRA base dequantized, a
base the checkpoints do not hold read from the pretrained checkpoint again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplug.errors import CheckpointError


def merged(checkpoints: Any, step: int, meta: dict[str, Any], alpha: float, rank: int,
           base: Any, canonical: Callable[[str], str]) -> dict[str, Any]:  # fmt: skip
    """A LoRA run's base parameters by their decoder names (``canonical``), each target's
    adapters merged in as it is read (a base the checkpoints do not hold read from ``base``,
    the :class:`~shardplug.pretrained.Pretrained` checkpoint)."""
    arrays, frozen = meta["arrays"], meta.get("frozen", {})
    qtype = meta.get("config", {}).get("lora_quantize")  # QLoRA: its targets stored quantized
    names = [n for n in (*arrays, *frozen) if n.startswith("params/base/")]
    if qtype:
        stems = {n.removesuffix("/values") for n in names if n.endswith("/values")}
        held = {s for s in stems if s + "/scale" in arrays or s + "/scale" in frozen}
        names = [n.rsplit("/", 1)[0] if n.rsplit("/", 1)[0] in held else n for n in names]
        names = list(dict.fromkeys(names))
    out: dict[str, Any] = {}
    for name in names:
        path = name.removeprefix("params/base/")
        key = "params/lora/" + path.replace("/", ".")
        factors = (key + "/l", key + "/r") if key + "/l" in arrays else None
        quantized = qtype if name + "/values" in arrays or name + "/values" in frozen else None
        source = base if name in frozen or name + "/values" in frozen else None
        out[canonical(path)] = Lazy(checkpoints, step, name, meta, factors, alpha / rank,
                                    quantized, source, canonical(path))  # fmt: skip
    return out


class Lazy:
    """One parameter of a training checkpoint, read when its first piece is asked for and
    let go after its last."""

    def __init__(self, checkpoints: Any, step: int, name: str, meta: dict[str, Any],
                 factors: tuple[str, str] | None = None, scale: float = 1.0,
                 quantized: str | None = None, base: Any = None,
                 decoder_name: str = ""):  # fmt: skip
        self.checkpoints, self.step, self.name = checkpoints, step, name
        self.factors, self.scale = factors, scale  # LoRA's, merged in as it is read
        self.quantized = quantized  # QLoRA's qtype: the base's values and scale, dequantized
        self.base, self.meta = base, meta  # where a frozen base not written is read from
        self.decoder_name = decoder_name  # its name there
        stored = name + "/scale" if quantized else name
        self.dtype = (base.dtype if base is not None
                      else np.dtype(jnp.dtype(meta["arrays"][stored]["dtype"])))  # fmt: skip
        self.uses, self._array = 0, None
        known = meta["arrays"].get(name) if base is None and not quantized else None
        self.shape = tuple(known["shape"]) if known and "shape" in known else None

    def __getitem__(self, position: tuple[int, ...]) -> np.ndarray:
        if self._array is None:
            if self.base is not None:
                self._array = self._from_base()
            elif self.quantized:
                self._array = self._dequantized()
            else:
                self._array = self.checkpoints.read_arrays(self.step, [self.name])[1][self.name]
            if self.factors is not None:
                got = self.checkpoints.read_arrays(self.step, list(self.factors))[1]
                left, right = (got[f] for f in self.factors)
                self._array = merge(self._array, left, right, self.scale)
        out = self._array[position] if position else self._array
        self.uses -= 1
        if self.uses <= 0:
            self._array = None
        return out

    def _from_base(self) -> np.ndarray:
        """The frozen weight read from the pretrained checkpoint again (quantized and
        dequantized as the run's was), refused where it is not the one the run trained on."""
        from shardplug.finetuning.quantize import quantized
        from shardplug.running.checkpoint import fingerprints

        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        weight = self.base._leaf(self.decoder_name, one)
        stored = {self.name: weight}
        if self.quantized:
            left, right = (self.meta["arrays"][f]["shape"] for f in self.factors)
            cut = len(left) - 1
            lead = len(right) - 1 - (weight.ndim - cut)
            q = quantized(weight, self.quantized, lead, cut)
            stored, weight = {self.name + "/values": q.values, self.name + "/scale": q.scale}, q
        frozen = self.meta["frozen"]
        if fingerprints(list(stored.values())) != [frozen[n] for n in stored]:
            raise CheckpointError(
                f"{self.base.directory}: {self.name.removeprefix('params/base/')} is not the "
                "base the run's adapters were trained on (its fingerprint differs): export with "
                "--init-from the checkpoint the run started from"
            )
        return np.asarray(weight.dequantized() if self.quantized else weight)

    def _dequantized(self) -> np.ndarray:
        """A QLoRA base weight, dequantized (a 4-bit one's packed dimension: its input's last,
        the second last of its factor ``L``)."""
        from shardplug.finetuning.quantize import Quantized

        names = [self.name + "/values", self.name + "/scale", *self.factors]
        got = self.checkpoints.read_arrays(self.step, names)[1]
        values, scale, left = got[names[0]], got[names[1]], got[names[2]]
        axis = left.ndim - 2 - values.ndim  # from the last
        packed = self.quantized != "int8" and values.shape[axis] * 2 == left.shape[-2]
        stored = Quantized(jnp.asarray(values), jnp.asarray(scale), self.quantized,
                           axis if packed else None)  # fmt: skip
        return np.asarray(stored.dequantized())


def merge(weight: np.ndarray, left: np.ndarray, right: np.ndarray, scale: float) -> np.ndarray:
    """``weight + scale L @ R`` (:mod:`shardplug.finetuning.lora`'s factors), in float32, cast
    back."""
    from shardplug.core.operations.beside import low_rank_delta

    lead = right.ndim - 1 - (weight.ndim - (left.ndim - 1))
    f32 = np.float32
    delta = low_rank_delta(left.astype(f32), right.astype(f32), lead, weight.shape, np.einsum)
    return (weight.astype(f32) + scale * delta).astype(weight.dtype)
