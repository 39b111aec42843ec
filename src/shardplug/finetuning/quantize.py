"""A frozen weight stored quantized by Qwix (QLoRA's base), dequantized where it is used.

:func:`quantized` quantizes one weight with :func:`qwix.quantize`: ``int8`` with one scale
per output (and per layer, per expert), ``int4`` or ``nf4`` (QLoRA's NormalFloat) with one
scale per block of :data:`BLOCK` inputs along the weight's last input dimension. A 4-bit
weight is stored two values a byte (``uint8``) along that dimension, as bitsandbytes stores
it: JAX's own 4-bit arrays cannot be a compiled program's argument on every backend (XLA:CPU
refuses their layout across devices), and bytes need no backend's support. Each byte holds
neighbours, so a layout that splits that dimension splits the bytes with no communication.
:meth:`Quantized.dequantized` rebuilds Qwix's ``QArray`` and calls :func:`qwix.dequantize`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

#: the storage a QLoRA run may ask for: Qwix's qtype for each
QTYPES: dict[str, Any] = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}
#: a 4-bit weight's inputs sharing one scale (QLoRA's block)
BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """One weight stored quantized: ``values`` (``int8``; a 4-bit weight's two to a byte
    along ``axis``), its ``scale`` (the weight's dtype, the dimensions it keeps whole), and
    Qwix's ``qtype`` by name."""

    values: jax.Array
    scale: jax.Array
    qtype: str = dataclasses.field(metadata={"static": True})
    #: the packed dimension, counted from the last (a layer's slice keeps it); None: none
    axis: int | None = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.values.shape)
        if self.axis is not None:
            shape[self.axis] *= 2
        return tuple(shape)

    @property
    def dtype(self) -> Any:
        return self.scale.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def dequantized(self) -> jax.Array:
        """The weight, in its own dtype (Qwix's ``dequantize``)."""
        import qwix

        values = self.values
        if self.axis is not None:  # two 4-bit values a byte: the low nibble first
            low, high = values & 0xF, values >> 4
            after = self.ndim + self.axis + 1
            values = jnp.stack([low, high], axis=after).reshape(self.shape)
        if self.qtype == "int4":  # a nibble's two's complement
            values = (values ^ 8).astype(jnp.int8) - 8
        return qwix.dequantize(qwix.QArray(values, self.scale, None, QTYPES[self.qtype]))


def quantized(w: jax.Array, qtype: str, lead: int, cut: int) -> Quantized:
    """``w`` (its first ``lead`` dimensions stacked, its input ``lead:cut``) quantized: a
    stacked weight a layer at a time (each its own scales), so the temporaries are one
    layer's."""
    import qwix

    if lead > 0:
        return jax.lax.map(lambda one: quantized(one, qtype, lead - 1, cut - 1), w)
    ndim = w.ndim
    if qtype == "int8":
        channels, tiles = (*range(lead), *range(cut, ndim)), {}
    else:
        channels = (*range(cut - 1), *range(cut, ndim))
        tiles = {cut - 1: BLOCK} if w.shape[cut - 1] % BLOCK == 0 else {}
    q = qwix.quantize(w, QTYPES[qtype], channelwise_axes=channels, tiled_axes=tiles)
    if qtype == "int8":
        return Quantized(q.qvalue, q.scale, qtype, None)
    values = q.qvalue.astype(jnp.int8).astype(jnp.uint8) & 0xF  # nibbles
    axis = cut - 1
    if w.shape[axis] % 2:  # no pairs along it: one value a byte
        return Quantized(values, q.scale, qtype, None)
    pairs = values.reshape(*w.shape[:axis], w.shape[axis] // 2, 2, *w.shape[axis + 1 :])
    low = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    high = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    return Quantized(low | (high << 4), q.scale, qtype, axis - ndim)


def is_quantized(x: Any) -> bool:
    return isinstance(x, Quantized)


def layout(w: Any, spec: P) -> Any:
    """A stored weight's layout, from the weight's ``spec``: a quantized one's values as the
    weight (a packed dimension's bytes as its values), its scales along the dimensions they
    keep whole."""
    if not is_quantized(w):
        return spec
    names = tuple(spec) + (None,) * (w.ndim - len(spec))
    kept = [n if s == d else None for n, s, d in zip(names, w.scale.shape, w.shape, strict=True)]
    return Quantized(P(*names[: w.ndim]), P(*kept), w.qtype, w.axis)
