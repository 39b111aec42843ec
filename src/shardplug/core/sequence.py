"""Attention over a sequence split across devices: what ``cp`` puts in place of
:func:`shardplug.attention` while the step is traced.

The batch's sequence dimension (and every activation along it) is split over the context
axis in contiguous blocks; attention needs every key for each query. Here the keys and
values are all-gathered over the axis, once per attention call, while the queries, the
scores and the output stay split: each device computes the rows of its own queries against
the whole sequence, the causal mask taken at the real (global) positions, so the model, its
positions and the loss see the sequence as it is. The gather moves ``2 x (C-1)/C`` of one
layer's keys and values per device, small next to the attention's ``O(L^2)`` compute, and the
scores, the largest activation, are ``1/C`` of a device's without ``cp`` (MaxText's default
scheme; Accelerate recommends it too).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.attention import attention_override, choose
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
        implementation, _ = choose(query, key, value, platform=jax.default_backend())
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, is_causal=causal,
            implementation="xla" if implementation == "cudnn" else implementation,
        )  # fmt: skip
        return lay_out(out, split)

    return attend


@contextlib.contextmanager
def sequence_parallel(axis: str, name: str) -> Iterator[None]:
    """Trace the code inside with :func:`shardplug.attention` attending over the sequence
    split on ``axis``; a program that never called it is warned of once (its attention, if
    any, then runs through the compiler's own gathers of the sequence)."""
    called = []
    attend = gathered_attention(axis)

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
