"""cp's attention over the sequence split on the context axis: the ring (the default) and
the gather scheme, built from :mod:`shardplug.plugin`'s attention blocks.

The batch's sequence dimension (and every activation along it) is split over the context
axis in contiguous blocks; attention needs every key for each query. Two schemes, the causal
mask always taken at the real (global) positions, so the model, its positions and the loss
see the sequence as it is:

- :func:`ring_attention` (the default): each device keeps its blocks, and the key/value
  blocks go round the ring, ``C - 1`` ``ppermute`` calls forward and as many back, met with an
  online softmax: scores of one block pair at a time. Causal, the blocks are dealt zig-zag
  for the span of the attention (and the output dealt back), so that every device computes
  the same half of each block pair and skips the masked half.
- :func:`gathered_attention`: keys and values all-gathered over the axis, queries, scores
  and output split (MaxText's default; Accelerate recommends it).

Measured side by side (``benchmarks/cp_attention.py``, 4 CPU devices, the reference
transformer, batch 4): ring (zig-zag) / gather step time 0.51 at sequence 1024 and 0.23 at
4096, compiled temporaries 0.40 and 0.28; without the zig-zag the ring's were 0.59 and 0.35,
0.44 and 0.32. So the balanced ring is the default. Attention alone against a ring written
by hand (``--alone``, sequence 4096): 0.71x its time and 0.67x its memory. Inside another
per-device program (a pipeline schedule's) XLA's partitioner refuses the ring's nested manual
axes, and the keys and values are gathered there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from shardplug.plugin import P, is_explicit, lay_out
from shardplug.plugin.attention import (
    fold,
    fold_end,
    fold_start,
    fused_here,
    pad_sequence,
    pair_attention,
    softmax_end,
    softmax_join,
    softmax_meet,
    softmax_rows,
    softmax_start,
    with_segments,
)

_U = P.UNCONSTRAINED


def gathered_attention(axis: str):
    """An attention function (cp's ``Operations(attention=...)``): keys and values whole along
    the sequence (gathered over ``axis``), queries and output split over it."""

    def attend(query, key, value, *, causal, bias, mask, scale, segment_ids=None):
        size = jax.sharding.get_abstract_mesh().shape[axis]
        length = query.shape[1]
        (query, key, value), bias, mask = pad_sequence((query, key, value), bias, mask, size)
        split, whole = P(_U, axis, _U, _U), P(_U, None, _U, _U)
        query = lay_out(query, split)
        key, value = lay_out(key, whole), lay_out(value, whole)
        padded = query.shape[1] != length
        if segment_ids is not None:  # the queries' ids split as they are, the keys' whole
            ids = pad_ids(segment_ids, query.shape[1])
            mask = with_segments(mask, lay_out(ids, P(_U, axis)), lay_out(ids, P(_U, None)))
        # XLA's: cuDNN's wrapper has no partitioning rule for split queries against whole keys
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, is_causal=causal,
            key_value_seq_lengths=(
                jnp.full(query.shape[:1], length, jnp.int32) if padded else None
            ),
            implementation="xla",
        )  # fmt: skip
        return lay_out(out, split)[:, :length]

    return attend


def ring_attention(axis: str, balance: bool = True, on_ring=None, fused: bool | None = None):
    r"""An attention function (cp's ``Operations(attention=...)``): each device keeps its block of
    queries, keys and values, and the key/value blocks go round the ring over ``axis``
    (``C - 1`` ``ppermute``\s), each met with an online softmax (running maximum, sum and
    output in float32), so no device ever holds more than one other block, nor scores of
    more than one block pair. The backward pass is autodiff through the ring (the
    transposed ``ppermute``\s send the key/value gradients back), each step recomputed.
    ``on_ring()`` is called each time the ring itself is traced (not its gathered fallback).
    ``fused`` (None: a GPU's choice, :func:`~shardplug.plugin.attention.fused_here`): each
    block pair meets in the fused kernel (off a GPU, in Pallas' interpreter)."""
    gathered = gathered_attention(axis)

    def attend(query, key, value, *, causal, bias, mask, scale, segment_ids=None):
        mesh = jax.sharding.get_abstract_mesh()
        if gathers_here(bias, mask):
            return gathered(query, key, value, causal=causal, bias=bias, mask=mask,
                            scale=scale, segment_ids=segment_ids)  # fmt: skip
        if on_ring is not None:
            on_ring()
        size = mesh.shape[axis]
        length = query.shape[1]
        # any length: padded at the end to whole blocks (two chunks each when dealt); causal,
        # no real query sees a padded key, otherwise the ring masks them by their position
        dealt = causal and balance
        (query, key, value), _, _ = pad_sequence((query, key, value), None, None,
                                                 2 * size if dealt else size)  # fmt: skip
        valid = None if causal or query.shape[1] == length else length
        split = P(_U, axis, _U, _U)  # explicit axes: their types must say it
        query, key, value = (lay_out(x, split) for x in (query, key, value))
        fuse = fused_blocks(query, key, value, size * (2 if dealt else 1), fused)
        block = functools.partial(
            ring_block, axis=axis, size=size, causal=causal, scale=scale, balance=balance,
            valid=valid, fused=fuse,
        )  # fmt: skip
        split = P(None, axis)
        blocks = (query, key, value)
        if segment_ids is not None:  # each block's ids go round the ring with its keys
            blocks += (lay_out(pad_ids(segment_ids, query.shape[1]), P(_U, axis)),)
        # a Pallas kernel's outputs do not say how they vary: the fused ring is unchecked
        out = jax.shard_map(block, in_specs=(split,) * len(blocks), out_specs=split,
                            axis_names={axis}, check_vma=not fuse)(*blocks)  # fmt: skip
        return unpadded(out, length)

    return attend


def fused_blocks(query, key, value, parts: int, fused: bool | None = None) -> bool:
    """``fused``, or where it is None whether a GPU meets the blocks of a sequence cut in
    ``parts`` in its fused kernel (:func:`~shardplug.plugin.attention.fused_here`)."""
    if fused is not None:
        return fused
    part = query.shape[1] // parts
    return fused_here(*(jax.ShapeDtypeStruct((x.shape[0], part, *x.shape[2:]), x.dtype)
                        for x in (query, key, value)))  # fmt: skip


def gathers_here(bias, mask) -> bool:
    """Whether a scheme of its own (the ring, the all-to-alls) leaves this attention to the
    gather: it takes plain (causal) attention, packed documents' ids too, not a bias or a
    mask; and inside another per-device program (pp's schedule) XLA's partitioner refuses its
    nested manual axes."""
    nested = any(t == jax.sharding.AxisType.Manual
                 for t in jax.sharding.get_abstract_mesh().axis_types)  # fmt: skip
    return bias is not None or mask is not None or nested


def unpadded(out, length: int):
    """``out`` (rows, sequence padded to whole blocks, ...) cut back to ``length``; on
    explicit axes, where a split must be even, the sequence whole first."""
    if out.shape[1] == length:
        return out
    if is_explicit(jax.sharding.get_abstract_mesh()):
        out = lay_out(out, P(_U, None, *([_U] * (out.ndim - 2))))
    return out[:, :length]


def pad_ids(ids, length):
    """Segment ids padded at the end to ``length`` with -1, no real segment's."""
    return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), constant_values=-1)


def ring_block(q, k, v, ids=None, *, axis, size, causal, scale, balance, valid=None, groups=1,
               fused=False):  # fmt: skip
    """One device's share of ring attention: its queries against every block of keys.

    Causal and ``balance``, the blocks are first dealt zig-zag (:func:`_deal`): device ``i``
    holds chunks ``i`` and ``2C-1-i`` of the sequence's ``2C``, so against every other
    device's block it has exactly half a block pair to compute, none of it masked: all its
    queries against an earlier device's first half, or its second half of queries against a
    later device's whole block. Each device computes ``(C + 1) / 2C`` of the block pairs that
    causal attention without the deal does (all of them, masked), all devices the same; the
    output is dealt back, so nothing outside sees the order. Key and value blocks carry
    their own heads, which may be fewer than the queries' (grouped-query attention): only
    they go round the ring. ``valid``: keys at positions from it on are padding, masked.
    ``ids``: my block's segment ids; each key block's go round with it, and a query meets
    only its own segment's keys.

    ``fused``: each meeting is :func:`~shardplug.plugin.attention.pair_attention` (a GPU's
    kernel), folded by its log-sum-exp, and the ids (all 0, padding -1, where there are
    none) go round the ring; otherwise XLA's online softmax.

    ``groups`` (cp's hybrid scheme): the ``axis`` holds ``groups`` rings of ``size`` places
    each, device ``d`` at place ``d // groups`` of ring ``d % groups`` (the all-to-alls run
    within ``groups`` consecutive devices, the rings across them)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    me = jax.lax.axis_index(axis) // groups
    perm = on_devices([(d, (d + 1) % size) for d in range(size)], groups)
    length = q.shape[1]
    if fused and ids is None:  # the kernel keeps keys apart by ids: padding's are -1
        places = me * length + jnp.arange(length)
        real = places < valid if valid is not None else jnp.ones((length,), bool)
        ids = jnp.broadcast_to(jnp.where(real, 0, -1), q.shape[:2]).astype(jnp.int32)
    dealt = causal and balance
    if dealt:
        q, k, v = (_deal(x, axis, size, groups=groups) for x in (q, k, v))
        ids = None if ids is None else _deal(ids, axis, size, groups=groups)
    half = length // 2
    pair = _Pairs(scale, causal, valid, fused)

    def meet(acc, k, v, theirs, step):
        source = (me - step) % size  # whose keys and values these are
        if not dealt:
            return pair.meet(acc, q, k, v, ids, theirs, *pair.places(me, source, length))

        def earlier(acc):  # all my queries against its first half
            return pair.meet(acc, q, k[:, :half], v[:, :half], ids, _cut(theirs, slice(half)))

        def later(acc):  # my second half of queries against all of it
            rows = slice(half, None)
            mine = pair.meet(softmax_rows(acc, rows), q[:, rows], k, v, _cut(ids, rows),
                             theirs)  # fmt: skip
            return softmax_join(softmax_rows(acc, slice(None, half)), mine)

        return jax.lax.cond(source < me, earlier, later, acc)

    def meet_and_pass(carry, step):  # the block passed on is the next step's carry: kept,
        acc, k, v, theirs = carry  # not recomputed by the checkpoint
        passed = jax.lax.ppermute((k, v, theirs), axis, perm)
        return (meet(acc, k, v, theirs, step), *passed), None

    acc = pair.start(q, v.shape[-1])
    places = pair.places(me, me, length)
    if dealt:  # my own block: causal at the dealt positions
        steps = jnp.arange(half)
        where = jnp.concatenate([me * half + steps, (2 * size - 1 - me) * half + steps])
        places = where, where
    # every meeting recomputed for the backward pass: only the running sums are kept
    acc = jax.checkpoint(lambda acc, k, v: pair.meet(acc, q, k, v, ids, ids, *places))(acc, k, v)
    theirs = ids if ids is not None else jnp.zeros((q.shape[0], 0), jnp.int32)
    k, v, theirs = jax.lax.ppermute((k, v, theirs), axis, perm)
    steps = jnp.arange(1, size - 1)
    acc, k, v, theirs = jax.lax.scan(jax.checkpoint(meet_and_pass), (acc, k, v, theirs),
                                     steps)[0]  # fmt: skip
    out = pair.end(jax.checkpoint(meet)(acc, k, v, theirs, size - 1), q.dtype)
    return _deal(out, axis, size, back=True, groups=groups) if dealt else out


def _cut(ids, rows):
    return None if ids is None or not ids.shape[1] else ids[:, rows]


class _Pairs:
    """How a ring's block pairs meet: fused (:func:`pair_attention`, folded by log-sum-exp)
    or XLA's online softmax, each given the queries' and keys' ids and places."""

    def __init__(self, scale, causal, valid, fused):
        self.scale, self.causal, self.valid, self.fused = scale, causal, valid, fused

    def places(self, mine, theirs, length):
        """The real positions of my block's queries and of ``theirs``'s keys (contiguous)."""
        steps = jnp.arange(length)
        return mine * length + steps, theirs * length + steps

    def start(self, q, dim):
        return fold_start(q, dim) if self.fused else softmax_start(q, dim)

    def end(self, acc, dtype):
        return fold_end(acc, dtype) if self.fused else softmax_end(acc, dtype)

    def meet(self, acc, q, k, v, mine, theirs, q_places=None, k_places=None):
        """``acc`` after ``q`` meets ``k``, ``v``: places given, causal where the ring is (and
        its padding masked), else every key seen; ids given, each query's own segment's."""
        causal = self.causal and q_places is not None
        if self.fused:
            if q_places is None:
                q_places, k_places = jnp.zeros(q.shape[1:2], int), jnp.zeros(k.shape[1:2], int)
            return fold(acc, pair_attention(q, k, v, mine, theirs, q_places, k_places,
                                            causal=causal, scale=self.scale))  # fmt: skip
        seen = None
        if causal:
            seen = q_places[:, None] >= k_places[None, :]
        elif self.valid is not None and k_places is not None:
            seen = jnp.broadcast_to(k_places < self.valid, (q.shape[1], k.shape[1]))
        if mine is not None and theirs is not None and theirs.shape[1]:
            same = (mine[:, :, None] == theirs[:, None, :])[:, None]  # (rows, 1, q, k)
            seen = same if seen is None else jnp.logical_and(seen[None, None], same)
        return softmax_meet(q, k, v, acc, self.scale, seen)


def on_devices(pairs: list[tuple[int, int]], groups: int) -> list[tuple[int, int]]:
    """A permutation of places on a ring as the devices' of every ring (``ring_block``'s
    ``groups``): place ``g`` of ring ``j`` is device ``g * groups + j``."""
    return [(a * groups + j, b * groups + j) for a, b in pairs for j in range(groups)]


def _deal(x, axis: str, size: int, back: bool = False, groups: int = 1):
    r"""Contiguous blocks to zig-zag ones and (``back``) again, along dimension 1 of one
    device's block: with the sequence in ``2C`` chunks, device ``i`` holds chunks ``2i`` and
    ``2i+1`` before and chunks ``i`` and ``2C-1-i`` after; two half-block ``ppermute``\s."""
    owner = [c if c < size else 2 * size - 1 - c for c in range(2 * size)]
    evens = [(d, owner[2 * d]) for d in range(size)]  # chunk 2d's way, a permutation
    odds = [(d, owner[2 * d + 1]) for d in range(size)]
    half = x.shape[1] // 2
    even = (jax.lax.axis_index(axis) // groups) % 2 == 0  # my first chunk's number is even
    evens, odds = on_devices(evens, groups), on_devices(odds, groups)
    if not back:
        got_even = jax.lax.ppermute(x[:, :half], axis, evens)
        got_odd = jax.lax.ppermute(x[:, half:], axis, odds)
        first, second = jnp.where(even, got_even, got_odd), jnp.where(even, got_odd, got_even)
        return jnp.concatenate([first, second], 1)
    first, second = x[:, :half], x[:, half:]
    even_chunk, odd_chunk = jnp.where(even, first, second), jnp.where(even, second, first)
    return jnp.concatenate([
        jax.lax.ppermute(even_chunk, axis, [(b, a) for a, b in evens]),
        jax.lax.ppermute(odd_chunk, axis, [(b, a) for a, b in odds]),
    ], 1)  # fmt: skip
