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
must divide the context axis: where they do not, the hybrid (``scheme="hybrid"``: USP's,
Megatron's ``a2a+p2p``) splits the heads within groups of ``A`` consecutive devices, ``A``
the most that divide both, and runs cp's ring across the ``C / A`` groups: one all-to-all
within each group, then each device attends for its ``heads / A`` heads over its group's
block of the sequence, that block meeting the other groups' round the ring (zig-zag dealt,
causal), and one all-to-all back. Padding (a sequence the devices do not divide) and packed
documents' segment ids are handled as the ring does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from shardplug.plugin import (
    ConfigError,
    P,
    attention_kernel,
    batch_axes,
    lay_out,
    mesh_axes,
    sharding_of,
    warn_once,
)
from shardplug.plugin.attention import pad_sequence
from shardplug.strategies.cp.ring import (
    fused_blocks,
    gathered_attention,
    gathers_here,
    pad_ids,
    ring_block,
    unpadded,
)

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


def group_size(heads: int, kv_heads: int, size: int) -> int:
    """The hybrid's all-to-all group: the most consecutive devices of the ``size`` that the
    query heads divide, the key/value heads repeated to divide them too (1: the ring alone)."""
    for groups in range(size, 0, -1):
        if size % groups == 0 and heads % groups == 0:
            try:
                kv_repeats(heads, kv_heads, groups)
            except ConfigError:
                continue
            return groups
    return 1


def ulysses_attention(axis: str, on_all_to_all=None, hybrid: bool = False,
                      balance: bool = True, on_ring=None):  # fmt: skip
    """An attention function (cp's ``Operations(attention=...)``) by all-to-alls over
    ``axis`` (see the module); with ``hybrid``, all-to-alls within groups and the ring
    across them (``balance``: dealt zig-zag, causal; ``on_ring()`` called where a ring
    runs); the gather scheme where a bias or mask is given or inside another per-device
    program; ``on_all_to_all(bytes, group)`` is told each call's query, key, value and
    output block bytes and the devices they are spread over (for explain's textbook)."""
    gathered = gathered_attention(axis)

    def attend(query, key, value, *, causal, bias, mask, scale, segment_ids=None):
        mesh = jax.sharding.get_abstract_mesh()
        if gathers_here(bias, mask):
            return gathered(query, key, value, causal=causal, bias=bias, mask=mask,
                            scale=scale, segment_ids=segment_ids)  # fmt: skip
        size = mesh.shape[axis]
        rows, tp, apart, groups = _split(mesh, axis, query, key, hybrid)
        rings = size // groups  # the places on each ring (1: Ulysses alone)
        repeats = kv_repeats(query.shape[2] // apart, key.shape[2] // apart, groups)
        length = query.shape[1]
        dealt = rings > 1 and causal and balance  # each ring place's block in two halves
        whole = math.lcm(size, 2 * rings) if dealt else size
        (query, key, value), _, _ = pad_sequence((query, key, value), None, None, whole)
        padded = query.shape[1]
        lead = rows if rows else None
        by_tp = (tp if len(tp) > 1 else tp[0]) if tp else None
        split = P(lead, axis, by_tp, _U)  # the heads whole where tp's axes are not manual
        blocks = [lay_out(x, split) for x in (query, key, value)]
        specs = [P(lead, axis, by_tp)] * 3
        if segment_ids is not None:  # every device reads its rows' every position's ids
            blocks.append(lay_out(pad_ids(segment_ids, padded), P(lead, None)))
            specs.append(P(lead))
        if on_all_to_all is not None:  # one device's blocks: its rows, its positions
            part = padded // size
            share = math.prod(mesh.shape[a] for a in rows)
            sizes = [x.shape[0] // share * part * x.shape[2] * (1 if x is query else repeats)
                     // apart * x.shape[3] * x.dtype.itemsize
                     for x in (query, key, value)]  # fmt: skip
            if groups > 1:
                on_all_to_all(sum(sizes) + sizes[0], groups)  # and the output, as the query
        if rings > 1 and on_ring is not None:
            on_ring()
        local = _per_device(axis, groups, rings, repeats, padded, length, causal=causal,
                            scale=scale, balance=balance)  # fmt: skip
        # unchecked: Pallas' fused kernel (packed rows on a GPU) says not how it varies
        out = jax.shard_map(local, in_specs=tuple(specs), out_specs=P(lead, axis, by_tp),
                            axis_names={axis, *rows, *tp}, check_vma=False)(*blocks)  # fmt: skip
        return unpadded(out, length)

    return attend


def _split(mesh: Any, axis: str, query: Any, key: Any, hybrid: bool
           ) -> tuple[tuple[str, ...], tuple[str, ...], int, int]:  # fmt: skip
    """``(rows, tp, apart, groups)``: the batch axes manual beside ``axis``, tensor
    parallelism's axes over the heads (``apart`` devices), and the all-to-all's group."""
    size = mesh.shape[axis]
    heads, kv_heads = query.shape[2], key.shape[2]
    # the rows' axes manual too: left to the partitioner, it gathers the rows whole
    # before an all-to-all along other dimensions
    rows = tuple(a for a in batch_axes() if a != axis and a in mesh.axis_names)
    if query.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = ()  # rows the axes do not divide (a model built on one sample row)
    # and tensor parallelism's, where it splits the heads: each device's own heads are
    # split over the context axis (left to the partitioner, they are gathered whole and
    # every tp device computes all of them)
    tp = _heads_axes(mesh, (axis, *rows), heads, kv_heads)
    apart = math.prod(mesh.shape[a] for a in tp)  # the devices tp splits the heads over
    mine, kv_mine = heads // apart, kv_heads // apart
    if not hybrid and mine % size and heads % size == 0:
        warn_once(
            f"cp scheme ulysses under tensor parallelism: the {mine} heads each device of "
            f"{tp} holds do not divide the {size} devices of {axis!r}, so they are "
            f"gathered whole for the all-to-all and each of those devices computes every "
            f"head of its share; -o cp.scheme=hybrid keeps them split"
        )
        tp, apart, mine, kv_mine = (), 1, heads, kv_heads
    if hybrid:
        return rows, tp, apart, group_size(mine, kv_mine, size)
    if mine % size:
        raise ConfigError(
            f"cp scheme ulysses splits the heads over {axis!r}: {heads} query heads do "
            f"not divide its {size} devices; use -o cp.scheme=hybrid (all-to-alls within "
            f"groups the heads divide, a ring across them) or -o cp.scheme=ring"
        )
    return rows, tp, apart, size


def _per_device(axis: str, groups: int, rings: int, repeats: int, padded: int, length: int,
                *, causal: bool, scale: Any, balance: bool) -> Any:  # fmt: skip
    """Each device's program: all-to-alls within its group (heads for positions), its
    attention (round the ring across the groups, where there are several), and back."""
    # the all-to-alls within each group of consecutive devices (None: the whole axis)
    within = None if rings == 1 else [list(range(g * groups, (g + 1) * groups))
                                      for g in range(rings)]  # fmt: skip

    def swap(x, split, concat):  # within the groups (one device each: nothing to swap)
        if groups == 1:
            return x
        return jax.lax.all_to_all(x, axis, split, concat, tiled=True,
                                  axis_index_groups=within)  # fmt: skip

    def local(q, k, v, ids=None):
        # (rows, C-th of the sequence, heads, dim) -> (rows, the group's C/A-th of the
        # sequence, A-th of the heads): the whole sequence for Ulysses alone (A = C)
        if repeats > 1:  # each of my key/value heads repeated in place: my query head h
            # still reads h // group, and the context groups split both alike
            k, v = (jnp.repeat(x, repeats, axis=2) for x in (k, v))
        q, k, v = (swap(x, 2, 1) for x in (q, k, v))
        if rings > 1:  # the group's block meets the other groups' round the ring
            span = padded // rings
            if ids is not None:
                place = jax.lax.axis_index(axis) // groups
                ids = jax.lax.dynamic_slice_in_dim(ids, place * span, span, 1)
            fused = fused_blocks(q, k, v, 2 if causal and balance else 1)
            out = ring_block(q, k, v, ids, axis=axis, size=rings, causal=causal,
                             scale=scale, balance=balance, groups=groups, fused=fused,
                             valid=None if causal or padded == length else length)  # fmt: skip
        else:
            lengths = None
            if padded != length and not causal:  # causal: no real query sees the padding
                lengths = jnp.full((q.shape[0],), length, jnp.int32)
            # the ids as they are: a GPU's fused kernel takes them (a mask elsewhere)
            out = attention_kernel(q, k, v, causal=causal, scale=scale, lengths=lengths,
                                   segment_ids=ids)  # fmt: skip
        return swap(out, 1, 2)


    return local


def _heads_axes(mesh, taken: tuple[str, ...], heads: int, kv_heads: int) -> tuple[str, ...]:
    """The mesh axes the run's rules split attention's heads over (tensor parallelism's),
    where they divide the query and the key/value heads alike; () elsewhere (said once:
    each device of those axes then computes every head)."""
    spec = sharding_of((None, None, "heads", None))
    axes = tuple(a for a in mesh_axes(P(spec[2])) if a in mesh.axis_names and a not in taken
                 and mesh.shape[a] > 1)  # fmt: skip
    apart = math.prod(mesh.shape[a] for a in axes)
    if axes and (heads % apart or kv_heads % apart):
        warn_once(
            f"cp's all-to-all attention under tensor parallelism: {heads} query and {kv_heads} "
            f"key/value heads do not both divide the {apart} devices of {axes}, so the heads "
            f"are gathered whole for attention and each of those devices computes every head"
        )
        return ()
    return axes
