"""Attention over a sequence split across devices: what ``cp`` puts in place of
:func:`shardplug.attention` while the step is traced.

The batch's sequence dimension (and every activation along it) is split over the context
axis in contiguous blocks; attention needs every key for each query. Two schemes, the causal
mask always taken at the real (global) positions, so the model, its positions and the loss
see the sequence as it is:

- :func:`ring_attention` (the default): each device keeps its blocks, and the key/value
  blocks go round the ring, ``C - 1`` ``ppermute`` calls forward and as many back, met with an
  online softmax: scores of one block pair at a time.
- :func:`gathered_attention`: keys and values all-gathered over the axis, queries, scores
  and output split (MaxText's default; Accelerate recommends it).

Measured side by side (``benchmarks/cp_attention.py``, 4 CPU devices, the reference
transformer, batch 4): ring / gather step time 0.68 at sequence 1024 and 0.35 at 4096,
compiled temporaries 0.51 and 0.41, so the ring is the default. Inside pp's pipeline
schedule (itself a per-device program) XLA's partitioner refuses the ring's nested manual
axes, and the keys and values are gathered there.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core.attention import attention_override
from shardplug.core.sharding import lay_out
from shardplug.errors import ShardplugWarning

_U = P.UNCONSTRAINED
_WARNED: set[str] = set()  # said once per parallelism and process


def gathered_attention(axis: str):
    """An attention function for :func:`attention_override`: keys and values whole along
    the sequence (gathered over ``axis``), queries and output split over it."""

    def attend(query, key, value, *, causal, bias, mask, scale):
        split, whole = P(_U, axis, _U, _U), P(_U, None, _U, _U)
        query = lay_out(query, split)
        key, value = lay_out(key, whole), lay_out(value, whole)
        # XLA's: cuDNN's wrapper has no partitioning rule for split queries against whole keys
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, is_causal=causal,
            implementation="xla",
        )  # fmt: skip
        return lay_out(out, split)

    return attend


def ring_attention(axis: str):
    r"""An attention function for :func:`attention_override`: each device keeps its block of
    queries, keys and values, and the key/value blocks go round the ring over ``axis``
    (``C - 1`` ``ppermute``\s), each met with an online softmax (running maximum, sum and
    output in float32), so no device ever holds more than one other block, nor scores of
    more than one block pair. The backward pass is autodiff through the ring (the
    transposed ``ppermute``\s send the key/value gradients back), each step recomputed."""
    gathered = gathered_attention(axis)

    def attend(query, key, value, *, causal, bias, mask, scale):
        mesh = jax.sharding.get_abstract_mesh()
        # the ring takes plain (causal) attention; inside another per-device program (pp's
        # schedule) XLA's partitioner refuses its nested manual axes: gathered there
        nested = any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)
        if bias is not None or mask is not None or nested:
            return gathered(query, key, value, causal=causal, bias=bias, mask=mask,
                            scale=scale)  # fmt: skip
        size = mesh.shape[axis]
        block = functools.partial(_ring, axis=axis, size=size, causal=causal, scale=scale)
        split = P(None, axis)
        return jax.shard_map(
            block, in_specs=(split, split, split), out_specs=split, axis_names={axis}
        )(query, key, value)

    return attend


def _ring(q, k, v, *, axis, size, causal, scale):
    """One device's share of ring attention: its queries against every block of keys."""
    f32 = jnp.float32
    length, dim = q.shape[1], q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    me = jax.lax.axis_index(axis)
    perm = [(d, (d + 1) % size) for d in range(size)]

    def meet(carry, step):
        top, total, out, k, v = carry
        source = (me - step) % size  # whose keys and values these are
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=f32) * scale
        seen = jnp.ones((length, length), bool)
        if causal:
            places = jnp.arange(length)
            seen = (me * length + places)[:, None] >= (source * length + places)[None, :]
        scores = jnp.where(seen, scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(-1))
        safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.where(seen, jnp.exp(scores - safe[..., None]), 0.0)
        fade = jnp.where(jnp.isfinite(top), jnp.exp(top - safe), 0.0)
        total = total * fade + weights.sum(-1)
        out = out * fade.transpose(0, 2, 1)[..., None] + jnp.einsum(
            "bhqk,bkhd->bqhd", weights.astype(v.dtype), v, preferred_element_type=f32
        )
        return new_top, total, out

    def step_and_pass(carry, step):
        *_, k, v = carry
        top, total, out = meet(carry, step)
        k, v = jax.lax.ppermute((k, v), axis, perm)
        return (top, total, out, k, v), None

    # made from q, so they carry its type: varying where it is (pp's stage axis too), and
    # laid out like it on explicit mesh axes
    zeros = jnp.zeros_like(q[..., 0], f32).transpose(0, 2, 1)  # (rows, heads, length)
    start = (zeros - jnp.inf, zeros, jnp.zeros_like(q, f32))
    carry, _ = jax.lax.scan(jax.checkpoint(step_and_pass), (*start, k, v), jnp.arange(size - 1))
    _, total, out = meet(carry, size - 1)
    return (out / total.transpose(0, 2, 1)[..., None]).astype(q.dtype)


@contextlib.contextmanager
def sequence_parallel(axis: str, name: str, scheme: str = "ring") -> Iterator[None]:
    """Trace the code inside with :func:`shardplug.attention` attending over the sequence
    split on ``axis``; a program that never called it is warned of once (its attention, if
    any, then runs through the compiler's own gathers of the sequence)."""
    called = []
    attend = ring_attention(axis) if scheme == "ring" else gathered_attention(axis)

    def counted(*args, **kwargs):
        called.append(True)
        return attend(*args, **kwargs)

    with attention_override(counted):
        yield
    if not called and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"{name}: the model never called shardplug.attention, so {name} did not gather "
            f"its keys and values: attention written by hand (an einsum, or "
            f"jax.nn.dot_product_attention) still computes right over the sequence split on "
            f"{axis!r}, through whatever gathers the compiler chooses (explain shows them); "
            f"call shardplug.attention(q, k, v, causal=True) instead",
            ShardplugWarning,
            stacklevel=3,
        )
