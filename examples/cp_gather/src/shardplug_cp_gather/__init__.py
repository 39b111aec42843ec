"""Context parallelism with all-gathered keys and values, written outside shardplug from
``shardplug.plugin`` alone: the proof that the published contract is enough.

The batch's sequence (every leaf's second dimension) splits over a ``seq`` axis, and every
activation along it. Attention needs every key for each query: the plugin supplies
attention (``Operations(attention=...)``), which gathers the keys and values over ``seq``
and keeps queries, scores and output split (MaxText's default scheme). A sequence the
devices do not divide is padded at its end, the padded keys masked by their length and the
padded rows cut. explain shows what the gathers cost.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from shardplug.plugin import (
    RANK,
    Axis,
    Capability,
    Explained,
    Operations,
    P,
    ShardplugWarning,
    attention_kernel,
    hookimpl,
    lay_out,
    pad_sequence,
)

_U = P.UNCONSTRAINED


def gathered_attention(axis: str):
    """Attention over a sequence split on ``axis``: keys and values gathered whole along it,
    queries and output split over it."""

    def attend(query, key, value, *, causal, bias, mask, scale):
        length, size = query.shape[1], jax.sharding.get_abstract_mesh().shape[axis]
        (query, key, value), bias, mask = pad_sequence((query, key, value), bias, mask, size)
        split, whole = P(_U, axis, _U, _U), P(_U, None, _U, _U)
        query, key, value = lay_out(query, split), lay_out(key, whole), lay_out(value, whole)
        padded = query.shape[1] != length
        out = attention_kernel(  # shardplug's: cuDNN's fused attention where it qualifies
            query, key, value, bias=bias, mask=mask, scale=scale, causal=causal,
            lengths=jnp.full(query.shape[:1], length) if padded else None,
        )  # fmt: skip
        return lay_out(out, split)[:, :length]

    return attend


class GatherContext:
    """Context parallel over `seq`: the sequence split, keys and values all-gathered."""

    unsupported = {  # noqa: RUF012 (declared fields, read by shardplug)
        Capability.WITHOUT_SEQUENCE: "it splits the batch's sequence; a model whose batch "
        "has none has nothing to split",
        Capability.UNEVEN_SHAPES: "a model of two plain layers has no sequence",
        Capability.BATCH_SPLIT: "it splits the sequence, not the rows",
    }

    @hookimpl
    def parallel_axis(self):
        # the sequence's place in the order; parameters stay whole on it, stored split there
        # by a sharding parallelism beside it (lends)
        return Axis("seq", rank=RANK["context"], logical=("length",), lends=True)

    @hookimpl
    def split_batch(self, shape, size, sequence):
        if sequence is False:  # features, labels: whole on the axis (core refuses a batch
            return None  # with no sequence at all, this plugin declaring without-sequence)
        return None if shape[1] % size else 1  # placed whole where it does not divide

    @hookimpl
    def operations(self, axis, mesh):
        if mesh.shape[axis] == 1:
            return None
        return Operations(attention=gathered_attention(axis), unused=self._unused)

    def _unused(self, name: str) -> None:
        if getattr(self, "_said", False):
            return
        self._said = True
        warnings.warn(
            "cp-gather: the model never called shardplug.attention; its attention computes "
            "right through the compiler's own gathers: call shardplug.attention instead",
            ShardplugWarning,
            stacklevel=2,
        )

    @hookimpl
    def explain_step(self, axis, mesh, step):
        split = [(leaf, s) for leaf, s in zip(step.batch, step.batch_shardings, strict=True)
                 if len(s.spec) > 1 and s.spec[1] == axis]  # fmt: skip
        if not split:
            return None
        leaf = split[0][0]
        size = mesh.shape[axis]
        gathered = sum(c["bytes"] for c in step.collectives if c["kind"] == "all-gather")
        report = {
            "axis": axis,
            "devices": size,
            "length": leaf.shape[1],
            "per_device": math.ceil(leaf.shape[1] / size),
            "all_gather_bytes": gathered,
        }
        note = (
            f"cp-gather: each device holds {report['per_device']} of the {leaf.shape[1]} "
            f"positions; keys and values all-gathered over {axis!r} ({gathered / 2**20:.2f} "
            f"MiB of all-gathers per device per step, with the parameters')"
        )
        return Explained(name="cp-gather", report=report, notes=(note,))
