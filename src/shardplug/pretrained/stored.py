"""The decoder's parameters against a family's stored tensors: which tensors make up each
parameter (one per layer, per expert), each tensor's shape, the block of a tensor that a
device's block of a parameter is, and a tensor made back from its parameters (a fused
tensor from all of its). Every family's names come from its module
(:func:`shardplug.pretrained.families.tensors`); nothing here knows a family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardplug.errors import PretrainedError
from shardplug.pretrained import decoder
from shardplug.pretrained.config import DecoderConfig
from shardplug.pretrained.families import tensors

Shape = tuple[int, ...]


def parameters(c: DecoderConfig) -> dict[str, tuple[Shape, tuple[str | None, ...]]]:
    """Every parameter by its name (``layers/q``), with its full shape and logical axes."""
    outer, layer = decoder.table(c)
    out = dict(outer)
    out.update({f"layers/{n}": ((c.layers, *s), ("layers", *a)) for n, (s, a) in layer.items()})
    return out


def pieces(c: DecoderConfig, name: str) -> list[tuple[tuple[int, ...], str]]:
    """``(position, tensor name)`` of every stored tensor that holds a part of parameter
    ``name``: the position indexes its leading (layer, expert) dimensions."""
    template = tensors(c)[name].tensor
    if not name.startswith("layers/"):
        return [((), template)]
    if "{e}" in template:
        return [((i, e), template.format(i=i, e=e))
                for i in range(c.layers) for e in range(c.experts)]  # fmt: skip
    return [((i,), template.format(i=i)) for i in range(c.layers)]


def _part(shape: Shape, position: tuple[int, ...], transposed: bool) -> Shape:
    part = shape[len(position) :]
    return part[::-1] if transposed else part


def layout(c: DecoderConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each stored tensor (in the order of the parameters that fill it) -> the ``(parameter,
    position)`` it holds, in order along its first axis."""
    where = tensors(c)
    out: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for name in parameters(c):
        for position, tensor in pieces(c, name):
            out.setdefault(tensor, []).append((where[name].offset, name, position))
    return {t: [(n, p) for _, n, p in sorted(held, key=lambda h: h[0])] for t, held in out.items()}


def shapes(c: DecoderConfig) -> dict[str, Shape]:
    """Each stored tensor's shape, as the config implies it (a fused one: its parameters'
    rows one after another)."""
    where, params = tensors(c), parameters(c)
    out = {}
    for tensor, held in layout(c).items():
        parts = [_part(params[n][0], p, where[n].transposed) for n, p in held]
        rows = 0
        for (name, _), part in zip(held, parts, strict=True):
            if where[name].offset != rows or part[1:] != parts[0][1:]:
                raise PretrainedError(f"{c.family}: {name} does not follow on in {tensor}")
            rows += part[0]
        out[tensor] = (rows, *parts[0][1:]) if len(held) > 1 else parts[0]
    return out


def block_index(c: DecoderConfig, name: str, shape: Shape, index: tuple[slice, ...],
                lead: int) -> tuple[slice, ...]:  # fmt: skip
    """The index into the stored tensor of a parameter's block ``index`` (less its ``lead``
    positional dimensions): reversed where stored transposed, shifted to the parameter's
    rows where fused."""
    stored = tensors(c)[name]
    rest = index[lead:][::-1] if stored.transposed else index[lead:]
    if not rest:
        return rest
    # the parameter's rows alone: a fused tensor holds others' after (or before) them
    rows = range(_part(shape, (0,) * lead, stored.transposed)[0])[rest[0]]
    return (slice(stored.offset + rows.start, stored.offset + rows.stop, rows.step), *rest[1:])


def made_back(c: DecoderConfig, held: list[tuple[str, tuple[int, ...]]],
              source: Callable[[str], Any]) -> Callable[[], np.ndarray]:  # fmt: skip
    """A function that gives a stored tensor whole from ``held``, the parameters it holds
    (:func:`layout`'s), each indexed by position: ``source(name)[position]``."""
    where = tensors(c)

    def piece(name: str, position: tuple[int, ...]) -> np.ndarray:
        whole = source(name)[position]
        return whole.T if where[name].transposed else whole

    def made() -> np.ndarray:
        parts = [piece(n, p) for n, p in held]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    return made
