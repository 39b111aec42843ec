"""cp's all-to-all scheme (DeepSpeed-Ulysses): the heads split over the context axis for
attention, the sequence split everywhere else.

Each device holds its block of the sequence, every head. Before attention one all-to-all per
query, key and value turns that into the whole sequence for ``heads / C`` of the heads; each
device attends over the whole sequence for its heads (shardplug's own attention: cuDNN's
fused kernel where it qualifies), and one all-to-all turns the output back. So each device
sends its query, key, value and output blocks once per layer, ``(C - 1) / C`` of each,
whatever the sequence length (the ring sends the key/value blocks ``C - 1`` times).

Grouped-query attention: the key/value heads are repeated the fewest times that make them
divide the axis, as DeepSpeed does, so that each device's query heads find theirs. The heads
must divide the context axis: where they do not, the ring (``scheme="ring"``) is the scheme
to use. Padding (a sequence the devices do not divide) and packed documents' segment ids
are handled as the ring does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shardplug.plugin import ConfigError, P, attention_kernel, batch_axes, lay_out
from shardplug.plugin.attention import pad_sequence, with_segments
from shardplug.strategies.cp.ring import gathered_attention, gathers_here, pad_ids

_U = P.UNCONSTRAINED


def kv_repeats(heads: int, kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that the key/value heads divide the
    ``size`` devices and the query heads stay in whole groups on each."""
    for r in range(1, heads // kv_heads + 1):
        if (kv_heads * r) % size == 0 and heads % (kv_heads * r) == 0:
            return r
    raise ConfigError(
        f"cp scheme ulysses: {kv_heads} key/value heads cannot be repeated to divide "
        f"{size} devices in whole groups of the {heads} query heads: use -o cp.scheme=ring"
    )


def ulysses_attention(axis: str, on_all_to_all=None):
    """An attention function (cp's ``Operations(attention=...)``) by all-to-alls over
    ``axis`` (see the module); the gather scheme where a bias or mask is given or inside
    another per-device program; ``on_all_to_all(bytes)`` is told each call's query, key,
    value and output block bytes (for explain's textbook)."""
    gathered = gathered_attention(axis)

    def attend(query, key, value, *, causal, bias, mask, scale, segment_ids=None):
        mesh = jax.sharding.get_abstract_mesh()
        if gathers_here(bias, mask):
            return gathered(query, key, value, causal=causal, bias=bias, mask=mask,
                            scale=scale, segment_ids=segment_ids)  # fmt: skip
        size = mesh.shape[axis]
        heads, kv_heads = query.shape[2], key.shape[2]
        if heads % size:
            raise ConfigError(
                f"cp scheme ulysses splits the heads over {axis!r}: {heads} query heads do "
                f"not divide its {size} devices; use -o cp.scheme=ring"
            )
        repeats = kv_repeats(heads, kv_heads, size)
        if repeats > 1:  # each head repeated in place: query head h still reads h // group
            key, value = (jnp.repeat(x, repeats, axis=2) for x in (key, value))
        length = query.shape[1]
        (query, key, value), _, _ = pad_sequence((query, key, value), None, None, size)
        padded = query.shape[1]
        # the rows' axes manual too: left to the partitioner, it gathers the rows whole
        # before an all-to-all along other dimensions
        rows = tuple(a for a in batch_axes() if a != axis and a in mesh.axis_names)
        if query.shape[0] % math.prod(mesh.shape[a] for a in rows):
            rows = ()  # rows the axes do not divide (a model built on one sample row)
        lead = rows if rows else None
        split = P(_U, axis, _U, _U)
        blocks = [lay_out(x, split) for x in (query, key, value)]
        specs = [P(lead, axis)] * 3
        if segment_ids is not None:  # every device reads its rows' every position's ids
            blocks.append(lay_out(pad_ids(segment_ids, padded), P(_U, None)))
            specs.append(P(lead))
        if on_all_to_all is not None:  # one device's blocks: its rows, its positions
            part = padded // size
            share = math.prod(mesh.shape[a] for a in rows)
            sizes = [x.shape[0] // share * part * x.shape[2] * x.shape[3] * x.dtype.itemsize
                     for x in (query, key, value)]  # fmt: skip
            on_all_to_all(sum(sizes) + sizes[0])  # and the output, as the query

        def local(q, k, v, ids=None):
            # (rows, C-th of the sequence, heads, dim) -> (rows, sequence, C-th of the heads)
            q, k, v = (jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))
            mask = None if ids is None else with_segments(None, ids, ids)
            lengths = None
            if padded != length and not causal:  # causal: no real query sees the padding
                lengths = jnp.full((q.shape[0],), length, jnp.int32)
            out = attention_kernel(q, k, v, causal=causal, mask=mask, scale=scale,
                                   lengths=lengths)  # fmt: skip
            return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

        out = jax.shard_map(
            local, in_specs=tuple(specs), out_specs=P(lead, axis), axis_names={axis, *rows}
        )(*blocks)
        return out[:, :length]

    return attend
