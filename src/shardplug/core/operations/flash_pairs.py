"""Attention of one block of queries against one block of keys, fused, with its log-sum-exp:
the meeting that attention split over devices folds block by block (a ring passes the key
blocks round and joins each meeting's output by its log-sum-exp).

Pallas' own flash kernel (:mod:`shardplug.core.operations.flash`) takes one sequence for the queries
and the keys and one array of segment ids for both, so it cannot meet my queries with
another device's keys, whose documents and positions are theirs. This kernel (Pallas,
lowered to Triton on a GPU, run by Pallas' interpreter anywhere) takes each side's segment
ids and positions: a query sees a key of its own document, and, causal, at a position not
after its own. It returns the output (float32, normalised) and the log-sum-exp of each
query's scores (float32, ``-inf`` where the block has no key the query sees, its output 0),
and its backward pass takes both cotangents: the log-sum-exp's enters as
``delta = rowsum(dO * O) - dlse``, so a meeting's output can be joined to others by
ordinary JAX and differentiated through. Causal, a block of keys wholly after a block of
queries is skipped; no score matrix larger than one tile is ever made.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

#: the forward's query and key tiles, the backward's (at most: a block shorter takes its own)
FORWARD = (128, 64)
BACKWARD = (64, 64)
_LOG2E = math.log2(math.e)
_MASKED = -1e30  # the score of a key a query does not see (finite: -inf - -inf is no number)
_DIMS = (16, 32, 64, 128, 256)


@functools.cache
def _pallas() -> Any:
    """Pallas and its Triton parameters (None where this JAX lacks them)."""
    try:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import triton as plgpu
    except ImportError:
        return None
    return (pl, plgpu) if hasattr(plgpu, "CompilerParams") else None


def fits(query: Any, key: Any, value: Any) -> str | None:
    """Why these (rows, positions, heads, dim) blocks cannot take the kernel; None when they
    can: a head dimension of 16 to 256, a power of two, the same for all three; as many key
    heads as query heads divide; blocks of a multiple of 16 positions."""
    if _pallas() is None:
        return "this JAX has no Pallas Triton backend"
    dim = query.shape[-1]
    if dim not in _DIMS or key.shape[-1] != dim or value.shape[-1] != dim:
        return (f"it takes a head dimension of {', '.join(map(str, _DIMS))} for queries, keys "
                f"and values alike, not {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
    if query.shape[2] % key.shape[2]:
        return f"it takes no {query.shape[2]} query heads over {key.shape[2]} key heads"
    if query.shape[1] % 16 or key.shape[1] % 16:
        return (f"it takes blocks of a multiple of 16 positions, not {query.shape[1]} and "
                f"{key.shape[1]}")
    return None


def pair_attention(query: jax.Array, key: jax.Array, value: jax.Array, query_ids: jax.Array,
                   key_ids: jax.Array, query_places: jax.Array, key_places: jax.Array, *,
                   causal: bool, scale: float, interpret: bool = False,
                   ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``query`` (rows, q, heads, dim) against ``key``/``value`` (rows, k, key heads, dim): a
    query sees a key whose id (``query_ids`` (rows, q), ``key_ids`` (rows, k)) is its own and,
    ``causal``, whose place (``query_places`` (q,), ``key_places`` (k,), int) is not after
    its own. Returns the output (rows, q, heads, dim) float32 and the log-sum-exp (rows,
    heads, q) float32. Grouped key heads are repeated to the query heads. Off a GPU (or
    ``interpret``) Pallas' interpreter runs it: exact, and slow."""
    from shardplug.core.operations.attention import _platform

    interpret = interpret or _platform() != "gpu"
    repeat = query.shape[2] // key.shape[2]
    if repeat > 1:
        key, value = (jnp.repeat(x, repeat, axis=2) for x in (key, value))
    ints = [x.astype(jnp.int32) for x in (query_ids, key_ids, query_places, key_places)]
    return _pair(query, key, value, *ints, bool(causal), float(scale), bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _pair(q, k, v, qi, ki, qp, kp, causal, scale, interpret):
    return _forward(q, k, v, qi, ki, qp, kp, causal, scale, interpret)


def _pair_fwd(q, k, v, qi, ki, qp, kp, causal, scale, interpret):
    out, lse = _forward(q, k, v, qi, ki, qp, kp, causal, scale, interpret)
    return (out, lse), (q, k, v, qi, ki, qp, kp, out, lse)


def _pair_bwd(causal, scale, interpret, residuals, cotangents):
    q, k, v, qi, ki, qp, kp, out, lse = residuals
    d_out, d_lse = cotangents
    seen = jnp.isfinite(lse)  # a query that saw no key: no gradient (its weights are all 0)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out) - d_lse
    delta = jnp.where(seen, delta, 0.0)
    lse = jnp.where(seen, lse, jnp.inf)  # exp(s - inf) = 0
    dq, dk, dv = _backward(q, k, v, qi, ki, qp, kp, lse, delta, d_out, causal, scale, interpret)
    return dq, dk, dv, None, None, None, None


_pair.defvjp(_pair_fwd, _pair_bwd)


def _tile(length: int, most: int) -> int:
    """The largest power of two up to ``most`` that divides ``length`` (Triton's blocks are
    powers of two: a block of 96 positions runs in tiles of 32)."""
    tile = most
    while length % tile:
        tile //= 2
    return tile


def _params(dim: int) -> Any:
    return _pallas()[1].CompilerParams(num_warps=4 if dim <= 64 else 8, num_stages=2)


def _seen(qi, ki, qp, kp, causal):
    seen = qi[:, None] == ki[None, :]
    return jnp.logical_and(seen, qp[:, None] >= kp[None, :]) if causal else seen


def _scores(q, k, scale):  # base 2: exp2(s * log2 e) is exp(s)
    return jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (scale * _LOG2E)


def _forward_tile(q_ref, k_ref, v_ref, qi_ref, ki_ref, qp_ref, kp_ref, o_ref, lse_ref, *,
                  scale, causal, tile):  # fmt: skip
    pl = _pallas()[0]
    q, qi, qp = q_ref[...], qi_ref[...], qp_ref[...]
    rows = q.shape[0]

    def meet(at, carry):
        out, top, total = carry
        v = v_ref[at, :]
        seen = _seen(qi, ki_ref[at], qp, kp_ref[at], causal)
        s = jnp.where(seen, _scores(q, k_ref[at, :], scale), _MASKED)
        new = jnp.maximum(top, s.max(-1))
        p = jnp.where(seen, jnp.exp2(s - new[:, None]), 0.0)
        fade = jnp.exp2(top - new)
        out = out * fade[:, None] + jnp.dot(p.astype(v.dtype), v,
                                            preferred_element_type=jnp.float32)  # fmt: skip
        return out, new, total * fade + p.sum(-1)

    def step(j, carry):
        at = pl.ds(j * tile, tile)
        if not causal:
            return meet(at, carry)
        ahead = jnp.min(kp_ref[at]) > jnp.max(qp)  # every key after every query: skipped
        return jax.lax.cond(ahead, lambda c: c, functools.partial(meet, at), carry)

    start = (jnp.zeros((rows, q.shape[1]), jnp.float32),
             jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))  # fmt: skip
    out, top, total = jax.lax.fori_loop(0, k_ref.shape[0] // tile, step, start)
    live = total > 0
    total = jnp.where(live, total, 1.0)
    o_ref[...] = (out / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(live, (top + jnp.log2(total)) / _LOG2E, -jnp.inf)


def _forward(q, k, v, qi, ki, qp, kp, causal, scale, interpret):
    pl, _ = _pallas()
    rows, length, heads, dim = q.shape
    tq, tk = _tile(length, FORWARD[0]), _tile(k.shape[1], FORWARD[1])
    whole_k = k.shape[1]
    return pl.pallas_call(
        functools.partial(_forward_tile, scale=scale, causal=causal, tile=tk),
        grid=(length // tq, rows, heads),
        in_specs=[
            pl.BlockSpec((None, tq, None, dim), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, whole_k, None, dim), lambda i, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, whole_k, None, dim), lambda i, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, tq), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, whole_k), lambda i, b, h: (b, 0)),
            pl.BlockSpec((tq,), lambda i, b, h: (i,)),
            pl.BlockSpec((whole_k,), lambda i, b, h: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, tq, None, dim), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, tq), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct((rows, heads, length), jnp.float32)],
        compiler_params=_params(dim), interpret=interpret, name="shardplug_pair_forward",
    )(q, k, v, qi, ki, qp, kp)  # fmt: skip


def _gradients_tile(lse, delta, q, k, v, do, seen, scale):
    """A tile's softmax weights and the scores' gradient (over ``scale``)."""
    p = jnp.where(seen, jnp.exp2(_scores(q, k, scale) - lse[:, None] * _LOG2E), 0.0)
    d_p = jnp.dot(do.astype(v.dtype), v.T, preferred_element_type=jnp.float32)
    return p, p * (d_p - delta[:, None])


def _dq_tile(q_ref, k_ref, v_ref, qi_ref, ki_ref, qp_ref, kp_ref, lse_ref, delta_ref, do_ref,
             dq_ref, *, scale, causal, tile):  # fmt: skip
    pl = _pallas()[0]
    q, qi, qp, do = q_ref[...], qi_ref[...], qp_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def meet(at, dq):
        k = k_ref[at, :]
        seen = _seen(qi, ki_ref[at], qp, kp_ref[at], causal)
        _, ds = _gradients_tile(lse, delta, q, k, v_ref[at, :], do, seen, scale)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    def step(j, dq):
        at = pl.ds(j * tile, tile)
        if not causal:
            return meet(at, dq)
        ahead = jnp.min(kp_ref[at]) > jnp.max(qp)
        return jax.lax.cond(ahead, lambda c: c, functools.partial(meet, at), dq)

    dq = jax.lax.fori_loop(0, k_ref.shape[0] // tile, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_tile(q_ref, k_ref, v_ref, qi_ref, ki_ref, qp_ref, kp_ref, lse_ref, delta_ref, do_ref,
              dk_ref, dv_ref, *, scale, causal, tile):  # fmt: skip
    pl = _pallas()[0]
    k, v, ki, kp = k_ref[...], v_ref[...], ki_ref[...], kp_ref[...]

    def meet(at, carry):
        dk, dv = carry
        q, do = q_ref[at, :], do_ref[at, :]
        seen = _seen(qi_ref[at], ki, qp_ref[at], kp, causal)
        p, ds = _gradients_tile(lse_ref[at], delta_ref[at], q, k, v, do, seen, scale)
        dv = dv + jnp.dot(p.astype(v.dtype).T, do.astype(v.dtype),
                          preferred_element_type=jnp.float32)  # fmt: skip
        return dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32), dv

    def step(i, carry):
        at = pl.ds(i * tile, tile)
        if not causal:
            return meet(at, carry)
        behind = jnp.max(qp_ref[at]) < jnp.min(kp)  # every query before every key: skipped
        return jax.lax.cond(behind, lambda c: c, functools.partial(meet, at), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // tile, step, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, qi, ki, qp, kp, lse, delta, do, causal, scale, interpret):
    pl, _ = _pallas()
    rows, length, heads, dim = q.shape
    keys = k.shape[1]
    tq, tk = _tile(length, BACKWARD[0]), _tile(keys, BACKWARD[1])
    kwargs = dict(compiler_params=_params(dim), interpret=interpret)

    def sides(tile_q, tile_k, by_query):  # the specs of q, k, v, ids, places, lse, delta, do
        def at(n, tile, mine):  # a tile of the grid's own side, else the side whole
            return (lambda i, b, h: i) if mine else (lambda i, b, h: 0), (tile if mine else n)

        (iq, sq), (ik, sk) = at(length, tile_q, by_query), at(keys, tile_k, not by_query)
        four = lambda size, index: pl.BlockSpec(  # noqa: E731
            (None, size, None, dim), lambda i, b, h: (b, index(i, b, h), h, 0))
        return [
            four(sq, iq), four(sk, ik), four(sk, ik),
            pl.BlockSpec((None, sq), lambda i, b, h: (b, iq(i, b, h))),
            pl.BlockSpec((None, sk), lambda i, b, h: (b, ik(i, b, h))),
            pl.BlockSpec((sq,), lambda i, b, h: (iq(i, b, h),)),
            pl.BlockSpec((sk,), lambda i, b, h: (ik(i, b, h),)),
            pl.BlockSpec((None, None, sq), lambda i, b, h: (b, h, iq(i, b, h))),
            pl.BlockSpec((None, None, sq), lambda i, b, h: (b, h, iq(i, b, h))),
            four(sq, iq),
        ], four(sq if by_query else sk, iq if by_query else ik)  # fmt: skip

    args = (q, k, v, qi, ki, qp, kp, lse, delta, do)
    specs, out = sides(tq, tk, True)
    dq = pl.pallas_call(
        functools.partial(_dq_tile, scale=scale, causal=causal, tile=tk),
        grid=(length // tq, rows, heads), in_specs=specs, out_specs=out,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), name="shardplug_pair_dq", **kwargs,
    )(*args)  # fmt: skip
    specs, out = sides(tq, tk, False)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_tile, scale=scale, causal=causal, tile=tq),
        grid=(keys // tk, rows, heads), in_specs=specs, out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2, name="shardplug_pair_dkv",
        **kwargs,
    )(*args)  # fmt: skip
    return dq, dk, dv




def fused_here(query: Any, key: Any, value: Any) -> bool:
    """Whether attention split over devices meets these blocks with :func:`pair_attention`:
    on a GPU (the mesh traced for's platform), where the blocks fit and no earlier compile
    refused Pallas' kernels; said once on a GPU where they cannot."""
    from shardplug.core.operations import attention

    if attention._platform() != "gpu":
        return False
    why = attention._refused("flash") or fits(query, key, value)
    if why is not None:
        attention.REFUSED.append(f"blocks of attention split over devices: {why}")
        attention._say_once(f"blocks of attention split over devices meet in XLA's attention, "
                            f"which makes each pair's scores whole, not fused: {why}")
    return why is None


__all__ = ["BACKWARD", "FORWARD", "fits", "fused_here", "pair_attention"]
