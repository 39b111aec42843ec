"""Attention as one function: the backend's fused kernel where it qualifies, XLA's otherwise.

``jax.nn.dot_product_attention`` with ``implementation=None`` takes XLA's path everywhere,
also on a GPU, where cuDNN's fused (flash) attention is several times faster and never
materialises the ``sequence x sequence`` scores. :func:`attention` asks for cuDNN when the
devices are NVIDIA GPUs and the inputs qualify (bfloat16 or float16, a head dimension that is
a multiple of 8 and at most 128, or 256 on Hopper), and says once why when they do not.

It is also an operation a parallelism may compute its own way (:mod:`shardplug.core.ops`):
one that splits the sequence supplies attention over it through its ``operations`` hook, so
the model's code does not change between strategies.

Packed documents: ``segment_ids`` (each token's document, ``(batch, sequence)``) keep each
query to the keys of its own document, in every path: XLA's as a mask (on a GPU too, said
once: cuDNN's fused kernel through JAX would take them only as a dense bias), ``cp``'s ring
and gather with each block's ids beside its keys. A parallelism's attention that does not
take ``segment_ids`` (a keyword of its own) is given the same mask instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp

from shardplug.core import ops
from shardplug.errors import ConfigError, warn_once

Implementation = Literal["cudnn", "xla"]

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    implementation: Implementation | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Scaled dot-product attention over ``(batch, sequence, heads, head_dim)`` arrays.

    The layout and arguments are ``jax.nn.dot_product_attention``'s (``causal`` is its
    ``is_causal``); key and value may have fewer heads than the query (grouped-query
    attention), dividing them. ``implementation=None`` chooses: cuDNN's fused attention on
    NVIDIA GPUs where the inputs qualify, XLA's otherwise; name one to insist (``"cudnn"``
    raises where it cannot run). Under a parallelism that supplies attention (over a
    sequence split across devices) that parallelism's implementation runs instead.
    ``segment_ids`` (``(batch, sequence)`` integers, the same for queries and keys): a query
    attends only to keys of its own segment (packed documents that do not see each other).

    Example, in any framework's forward pass::

        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w) for w in (wq, wk, wv))
        out = shardplug.attention(q, k, v, causal=True)  # (batch, seq, heads, head_dim)
    """
    ops.read_sequence(query.shape[1], key.shape[1])
    if segment_ids is not None:
        _check_segments(segment_ids, query, key)
    override = ops.supplied("attention")
    if override is not None:
        given = {}
        if segment_ids is not None and _takes_segments(override):
            given["segment_ids"] = segment_ids
        elif segment_ids is not None:  # one that takes none: their mask
            mask = with_segments(mask, segment_ids, segment_ids)
        return override(query, key, value, causal=causal, bias=bias, mask=mask, scale=scale,
                        **given)  # fmt: skip
    return attention_kernel(query, key, value, causal=causal, bias=bias, mask=mask,
                            scale=scale, implementation=implementation,
                            segment_ids=segment_ids)  # fmt: skip


def with_segments(mask: jax.Array | None, query_ids: jax.Array, key_ids: jax.Array) -> jax.Array:
    """``mask`` (``(batch, heads or 1, queries, keys)``, or None) and each query's segment
    equal to each key's: ``(batch, 1 or heads, queries, keys)``."""
    same = query_ids[:, None, :, None] == key_ids[:, None, None, :]
    return same if mask is None else jnp.logical_and(mask, same)


def _check_segments(ids: Any, query: Any, key: Any) -> None:
    if ids.ndim != 2 or ids.shape != (query.shape[0], query.shape[1]) or (
        key.shape[1] != query.shape[1]
    ):  # fmt: skip
        raise ConfigError(
            f"shardplug.attention: segment_ids {tuple(ids.shape)} must be (batch, sequence) = "
            f"{(query.shape[0], query.shape[1])}, the queries' and the keys' (self-attention)"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ConfigError(f"shardplug.attention: segment_ids must be integers, got {ids.dtype}")


def _takes_segments(fn: Any) -> bool:
    try:
        return "segment_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def attention_kernel(
    query: jax.Array, key: jax.Array, value: jax.Array, *, causal: bool = False,
    bias: jax.Array | None = None, mask: jax.Array | None = None, scale: float | None = None,
    lengths: jax.Array | None = None, implementation: Implementation | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """:func:`attention` on the arrays as they are, no parallelism's in its place: the fused
    kernel where the devices and inputs qualify, XLA's otherwise. A parallelism's own
    attention (``Operations(attention=...)``) calls it on the blocks it has gathered or
    dealt, so it runs cuDNN's fused attention where :func:`attention` would; ``lengths``
    (one per row) masks the keys past each row's length, as padding to split a sequence
    evenly needs (``jax.nn.dot_product_attention``'s ``key_value_seq_lengths``);
    ``segment_ids`` keep each document to itself: on a GPU through Pallas' flash kernel
    (:mod:`shardplug.core.operations.flash`: the scores never whole), elsewhere in the mask.

    Example, attention over keys and values gathered whole along a sequence axis::

        def attend(query, key, value, *, causal, bias, mask, scale):
            whole = P(P.UNCONSTRAINED, None, P.UNCONSTRAINED, P.UNCONSTRAINED)
            key, value = lay_out(key, whole), lay_out(value, whole)
            return attention_kernel(query, key, value, causal=causal, bias=bias, mask=mask,
                                    scale=scale)
    """
    if segment_ids is not None and implementation is None and _platform() == "gpu":
        from shardplug.core.operations import flash  # documents kept apart by a fused kernel

        why = _refused("flash") or flash.fits(query, key, value) or next(
            (f"it takes no {name} beside them" for name, x in (("bias", bias), ("mask", mask),
                                                     ("lengths", lengths)) if x is not None),
            None)  # fmt: skip
        if why is None:
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            try:
                return flash.packed_attention(query, key, value, segment_ids, causal=causal,
                                              scale=scale)  # fmt: skip
            except NotImplementedError:  # under vmap (a per-shard gradient): no rule there
                why = "it has no rule under vmap (a gradient computed per shard)"
        implementation = "xla"  # correct, said: XLA's masked attention makes the scores
        REFUSED.append(f"segment ids: {why}")
        _say_once(f"segment_ids take XLA's attention, which makes the scores whole, not "
                  f"Pallas' flash kernel (documents apart in linear memory): {why}")  # fmt: skip
    if segment_ids is not None:
        mask = with_segments(mask, segment_ids, segment_ids)
    if implementation is None:
        implementation, why = choose(query, key, value, platform=_platform())
        if why is not None:
            _say_once(why)
        if implementation == "cudnn":
            implementation = _try_cudnn(query, key, value, bias, mask, scale, causal, lengths)
    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, is_causal=causal,
        key_value_seq_lengths=lengths, implementation=implementation,
    )  # fmt: skip


def choose(query: Any, key: Any, value: Any, *, platform: str) -> tuple[Implementation, str | None]:
    """The implementation for these inputs on ``platform`` (``"cpu"``, ``"gpu"``, ...), and
    why a GPU does not get its fused kernel (None where it does, or where there is none)."""
    if platform != "gpu":
        return "xla", None  # XLA's attention is the only one on CPU (and TPU, here)
    dtype = jnp.result_type(query, key, value)
    if dtype not in FUSED_DTYPES:
        return "xla", (
            f"{jnp.dtype(dtype).name} inputs take XLA's attention: cuDNN's fused attention "
            "takes bfloat16 or float16 (train with --precision bf16, or precision='bf16' in Python)"
        )
    head = query.shape[-1]
    if head % 8 or head > 256:
        return "xla", (
            f"head dimension {head} takes XLA's attention: cuDNN's fused attention needs a "
            "multiple of 8, at most 128 (256 on Hopper)"
        )
    return "cudnn", None


#: why cuDNN's fused attention refused each call it refused (explain --target reads it)
REFUSED: list[str] = []


_REFUSING: list[tuple[str, str]] = []


@contextlib.contextmanager
def refusing(kernel: str, reason: str) -> Iterator[None]:
    """Within: :func:`attention` takes XLA's kernel where it would take ``kernel``'s
    (``"cudnn"``, or ``"flash"``: :mod:`shardplug.core.operations.flash`), for ``reason`` (said
    once,
    and kept in :data:`REFUSED`)."""
    _REFUSING.append((kernel, reason))
    try:
        yield
    finally:
        _REFUSING.pop()


def _refused(kernel: str) -> str | None:
    return next((why for k, why in reversed(_REFUSING) if k == kernel), None)


def partitioner_failed(exc: BaseException) -> tuple[str, str] | None:
    """Which fused attention kernel compiling failed in, and why: JAX's cuDNN partitioner
    (the rule that splits the kernel over a mesh, run by the compiler: it has layouts it
    cannot split), or Pallas' flash kernel as :mod:`shardplug.core.operations.flash` calls it (its
    rule's own refusal, or its lowering: a JAX whose Triton backend is gone); None for any
    other failure."""
    from shardplug.core.operations.flash import NO_RULE

    text = str(exc)
    last = next((line.strip() for line in reversed(text.splitlines()) if "Error:" in line),
                type(exc).__name__)  # fmt: skip
    if "fused_attention_stablehlo" in text:
        return "cudnn", f"JAX's cuDNN partitioner failed on this layout: {last}"
    lowering = "pallas_call_lowering" in text or "triton" in text.lower()
    if NO_RULE in text or ("shardplug/core/flash" in text and lowering):  # either kernel
        return "flash", f"Pallas' flash kernel failed to compile: {last}"
    return None


def _try_cudnn(query, key, value, bias, mask, scale, causal, lengths) -> Implementation:
    """``"cudnn"`` if cuDNN accepts these inputs when traced, ``"xla"`` (said once) if not:
    its wrapper may refuse inputs whose explicit shardings it has no rule for."""
    if (why := _refused("cudnn")) is not None:
        REFUSED.append(why)
        _say_once(f"cuDNN's fused attention refused these inputs ({why}); using XLA's")
        return "xla"
    try:
        jax.eval_shape(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal,
                key_value_seq_lengths=lengths, implementation="cudnn",
            ),
            query, key, value,
        )  # fmt: skip
    except Exception as exc:  # whatever cuDNN's wrapper refuses (dtypes, shapes, shardings)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        REFUSED.append(reason)
        _say_once(f"cuDNN's fused attention refused these inputs ({reason}); using XLA's")
        return "xla"
    return "cudnn"


def _platform() -> str:
    """The platform of the mesh the step is traced under, else of JAX's default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def _say_once(why: str) -> None:
    warn_once(f"shardplug.attention: {why}", stacklevel=4)


def packed_inputs(batch: Mapping[str, Any], length: int) -> dict[str, Any]:
    """A batch's ``segment_ids`` and ``positions`` (documents packed in a row, each on its
    own) for the ``length`` tokens the model reads: one a token read, or one a token of the
    row (the last, never read, cut)."""
    out = {}
    for name in ("segment_ids", "positions"):
        given = batch.get(name)
        if given is None:
            continue
        if given.ndim != 2 or given.shape[1] not in (length, length + 1):
            raise ConfigError(
                f"batch {name} {tuple(given.shape)}: give (rows, {length}), one per token the "
                f"model reads, or (rows, {length + 1}), one per token of the row"
            )
        out[name] = given[:, :length]
    return out
