"""Building blocks of attention over a sequence split across devices.

The online softmax (flash attention's, a ring's): the scores of one block of queries against
one block of keys at a time, folded into a running maximum, sum and output in float32, so no
device holds more than one block pair's scores. ``cp``'s ring is built from them::

    acc = softmax_start(q, value_dim=v.shape[-1])
    for k_block, v_block, seen in blocks_round_the_ring:       # one meeting each
        acc = softmax_meet(q, k_block, v_block, acc, scale, seen)
    out = softmax_end(acc, q.dtype)

Key and value blocks may have fewer heads than the queries (grouped-query attention):
consecutive query heads share one, as ``jax.nn.dot_product_attention`` pairs them.
:func:`pad_sequence` pads a sequence the devices do not divide; :func:`with_segments` makes
packed documents' mask from their ids.

On a GPU the meetings run fused (:func:`pair_attention`: Pallas, lowered to Triton; no score
matrix larger than a tile), each returning its output and log-sum-exp, folded by it::

    if fused_here(q, k, v):
        acc = fold_start(q, value_dim=v.shape[-1])
        for k_block, v_block, ids, places in blocks_round_the_ring:
            acc = fold(acc, pair_attention(q, k_block, v_block, my_ids, ids, my_places,
                                           places, causal=True, scale=scale))
        out = fold_end(acc, q.dtype)

:func:`softmax_rows` and :func:`softmax_join` take either running state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardplug.core.operations.attention import with_segments
from shardplug.core.operations.flash_pairs import fused_here, pair_attention

__all__ = ["Folded", "Softmax", "fold", "fold_end", "fold_start", "fused_here", "pad_sequence",
           "pair_attention", "softmax_end", "softmax_join", "softmax_meet", "softmax_rows",
           "softmax_start", "with_segments"]  # fmt: skip

#: a running (maximum, sum, output): (rows, heads, queries), the same, (rows, queries,
#: heads, value head_dim), all float32
Softmax = tuple[jax.Array, jax.Array, jax.Array]


def softmax_start(query: jax.Array, value_dim: int) -> Softmax:
    """The running softmax of ``query``'s rows before any key: maximum -inf, sums 0. Made
    from ``query``, so it carries its type (varying where it is, its layout on explicit
    axes)."""
    zeros = jnp.zeros_like(query[..., 0], jnp.float32).transpose(0, 2, 1)
    out = jnp.zeros_like(query[..., :1], jnp.float32) * jnp.zeros((1, 1, 1, value_dim))
    return zeros - jnp.inf, zeros, out


def softmax_meet(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    acc: Softmax,
    scale: float,
    seen: jax.Array | None = None,
) -> Softmax:
    """``acc`` updated with one block of keys and values (the ring's meeting): ``seen``
    (queries x keys, bool) says which pairs the mask keeps; a row none of whose keys are seen
    stays as it was."""
    top, total, out = acc
    f32 = jnp.float32
    rows, length, heads, _ = query.shape
    shared = key.shape[2]  # key/value heads
    if shared == heads:  # every query head its own: no group dimension in the program
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=f32)
    else:
        grouped = query.reshape(rows, length, shared, heads // shared, query.shape[-1])
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, key, preferred_element_type=f32)
    scores = scores.reshape(rows, heads, length, key.shape[1]) * scale
    if seen is not None:
        scores = jnp.where(seen, scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(-1))
    safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    weights = jnp.exp(scores - safe[..., None])
    if seen is not None:
        weights = jnp.where(seen, weights, 0.0)
    fade = jnp.where(jnp.isfinite(top), jnp.exp(top - safe), 0.0)
    total = total * fade + weights.sum(-1)
    weights = weights.astype(value.dtype)
    if shared == heads:
        update = jnp.einsum("bhqk,bkhd->bqhd", weights, value, preferred_element_type=f32)
    else:
        weights = weights.reshape(rows, shared, heads // shared, length, key.shape[1])
        update = jnp.einsum("bhgqk,bkhd->bqhgd", weights, value, preferred_element_type=f32)
    out = out * fade.transpose(0, 2, 1)[..., None] + update.reshape(out.shape)
    return new_top, total, out


def softmax_end(acc: Softmax, dtype: Any) -> jax.Array:
    """The attention output of a finished running softmax, ``(rows, queries, heads, dim)``."""
    _, total, out = acc
    total = jnp.where(total > 0, total, 1.0)  # a query that saw no key (padding): 0, not 0/0
    return (out / total.transpose(0, 2, 1)[..., None]).astype(dtype)


def softmax_rows(acc: Softmax | Folded, rows: slice) -> Softmax | Folded:
    """The running softmax (or :data:`Folded` state) of some of the queries (``rows``: a
    slice of the sequence)."""
    return tuple(x[:, rows] if x.ndim == 4 else x[..., rows] for x in acc)


def softmax_join(first: Softmax | Folded, second: Softmax | Folded) -> Softmax | Folded:
    """Two running softmaxes (or :data:`Folded` states) of consecutive query slices as one."""
    return tuple(jnp.concatenate((a, b), 1 if a.ndim == 4 else -1)
                 for a, b in zip(first, second, strict=True))  # fmt: skip


#: fused meetings folded so far: their log-sum-exp (rows, heads, queries) and output (rows,
#: queries, heads, value head_dim), both float32, the output normalised
Folded = tuple[jax.Array, jax.Array]


def fold_start(query: jax.Array, value_dim: int) -> Folded:
    """The folded state of ``query``'s rows before any key: log-sum-exp -inf, output 0."""
    top, _, out = softmax_start(query, value_dim)
    return top, out


def fold(acc: Folded, part: tuple[jax.Array, jax.Array]) -> Folded:
    """``acc`` and one more meeting's ``(output, log-sum-exp)`` (:func:`pair_attention`'s) as
    one: each output weighted by its share of the joint sum. A query no key has been seen by
    keeps lse -inf, output 0; the gradient stays finite there."""
    (lse, out), (part_out, part_lse) = acc, part
    top = jnp.maximum(lse, part_lse)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    mine, theirs = (jnp.where(jnp.isfinite(x), jnp.exp(x - safe), 0.0) for x in (lse, part_lse))
    total = mine + theirs
    live = total > 0
    total = jnp.where(live, total, 1.0)
    weights = [(w / total).transpose(0, 2, 1)[..., None] for w in (mine, theirs)]
    joined = out * weights[0] + part_out * weights[1]
    return jnp.where(live, safe + jnp.log(total), -jnp.inf), joined


def fold_end(acc: Folded, dtype: Any) -> jax.Array:
    """The attention output of a finished fold, ``(rows, queries, heads, dim)``."""
    return acc[1].astype(dtype)


def pad_sequence(
    qkv: tuple[jax.Array, ...], bias: Any, mask: Any, multiple: int
) -> tuple[tuple[jax.Array, ...], Any, Any]:
    """``qkv`` (and a ``bias`` or ``mask`` over their positions) padded at the end of the
    sequence (dimension 1) to a multiple of ``multiple`` positions: zeros, the mask's padding
    True. The caller masks the padded keys (causal attention never sees them from a real
    query) and cuts the padded rows off its output."""
    length = qkv[0].shape[1]
    extra = -length % multiple
    if not extra:
        return qkv, bias, mask

    def pad(x, value=0):
        if x is None:
            return None
        widths = [(0, 0)] * x.ndim
        for dim in (-2, -1):  # (..., queries, keys), each possibly broadcast (size 1)
            if x.shape[dim] == length:
                widths[dim] = (0, extra)
        return jnp.pad(x, widths, constant_values=value)

    seq = [(0, 0), (0, extra)] + [(0, 0)] * (qkv[0].ndim - 2)
    return tuple(jnp.pad(x, seq) for x in qkv), pad(bias), pad(mask, True)
