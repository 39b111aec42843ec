"""Packed documents on a fused kernel: attention whose rows hold several documents, each kept
to itself by ``segment_ids``, computed block by block without the scores (flash attention).

JAX's Pallas ships a GPU flash-attention kernel (``jax.experimental.pallas.ops.gpu.attention``,
written in Triton) that takes segment ids and a causal mask directly, forward and backward,
in memory linear in the sequence, and runs in Pallas' interpreter on a CPU, where it is
tested against XLA's masked attention. cuDNN's fused attention takes packed documents only
through a layout of offsets and lengths behind a function JAX does not export, and JAX's own
``dot_product_attention`` takes segments only as a dense mask (the scores made whole).

A Pallas call has no rule for a mesh, so each pass (the forward, with its log-sum-exp kept
for the backward, and the backward) is a ``custom_partitioning`` whose rule keeps the batch
and heads as the operands split them and the sequence and head dimension whole: each device
runs the kernel on its rows and heads. The kernel's own entry points are used (``mha`` with
its residuals, and its backward): where the installed JAX lacks them, :func:`available` says
so and attention takes XLA's path.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

#: the kernel's sequence block: a packed row's length is a multiple of it
BLOCK = 128
#: what the kernel's rule says of a layout it has no rule for (attention's retry reads it)
NO_RULE = "shardplug.flash: no rule for this layout"


@functools.cache
def _kernel() -> Any:
    """Pallas' GPU attention module, imported once (None where this JAX lacks it)."""
    import warnings

    try:
        with warnings.catch_warnings():  # JAX 0.12 points to Tokamax (its successor)
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as kernel
    except ImportError:  # a JAX without Pallas' GPU kernels (or without Triton's lowering)
        return None
    need = ("mha", "_mha_backward", "BlockSizes")
    return kernel if all(hasattr(kernel, n) for n in need) else None


def available() -> bool:
    """Whether the installed JAX has the Pallas flash kernel this module calls."""
    return _kernel() is not None


def fits(query: Any, key: Any, value: Any) -> str | None:
    """Why these inputs cannot take the kernel (None when they can): it takes one sequence
    for queries and keys, a multiple of :data:`BLOCK` long, one head dimension for all three,
    and as many key heads as query heads divide; inside a per-device program, one that does
    not check how values vary (its outputs do not say)."""
    if not available():
        return "this JAX has no Pallas flash-attention kernel for GPUs"
    if _manual() and getattr(jax.typeof(query), "vma", None):  # a checked shard_map
        return ("inside a per-device program that checks how values vary (check_vma), which "
                "its outputs do not say")
    length, heads, dim = query.shape[1], query.shape[2], query.shape[3]
    if key.shape[1] != length:
        return f"it takes no queries of {length} and keys of {key.shape[1]} positions"
    if length % BLOCK:
        return f"it takes no sequence of {length}, not a multiple of {BLOCK}"
    if dim < 16:  # Triton's matrix product takes no side under 16
        return f"it takes no head dimension of {dim}, under 16"
    if key.shape[3] != dim or value.shape[3] != dim:
        return "it takes no queries, keys and values of different head dimensions"
    if heads % key.shape[2]:
        return f"it takes no {heads} query heads over {key.shape[2]} key heads"
    return None


def packed_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     segment_ids: jax.Array, *, causal: bool, scale: float,
                     interpret: bool = False) -> jax.Array:  # fmt: skip
    """Attention of (batch, sequence, heads, dim) inputs within each document of
    ``segment_ids`` (batch, sequence), fused: no score matrix is made. Grouped key heads
    are repeated to the query heads. ``interpret``: Pallas' interpreter (any backend)."""
    repeat = query.shape[2] // key.shape[2]
    if repeat > 1:
        key, value = (jnp.repeat(x, repeat, axis=2) for x in (key, value))
    return _flash(query, key, value, segment_ids.astype(jnp.int32), causal, float(scale),
                  interpret, _manual())  # fmt: skip


def _manual() -> bool:
    """Whether the trace is inside a per-device program (a shard_map's manual axes): the
    kernel runs on each device's blocks as they are, with no partitioning rule."""
    return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, seg, causal, scale, interpret, local):
    return _forward(causal, scale, interpret, local)(q, k, v, seg)[0]


def _flash_fwd(q, k, v, seg, causal, scale, interpret, local):
    out, lse = _forward(causal, scale, interpret, local)(q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(causal, scale, interpret, local, residuals, d_out):
    dq, dk, dv = _backward(causal, scale, interpret, local)(*residuals, d_out)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _spec(sharding: Any, rank: int) -> tuple:
    if not hasattr(sharding, "spec"):  # a layout named by devices alone: no axes to keep
        raise ValueError(f"{NO_RULE} ({type(sharding).__name__})")
    spec = tuple(sharding.spec) + (None,) * rank
    return spec[:rank]


def _split(arg_shapes: Any) -> tuple[Any, Any]:
    """The batch's and heads' mesh axes, as the queries are split (the rest whole)."""
    batch, _, heads, _ = _spec(arg_shapes[0].sharding, 4)
    return batch, heads


def _layouts(mesh: Any, batch: Any, heads: Any) -> dict[str, NamedSharding]:
    return {
        "bthd": NamedSharding(mesh, P(batch, None, heads, None)),
        "bt": NamedSharding(mesh, P(batch, None)),
        "bht": NamedSharding(mesh, P(batch, heads, None)),
    }


@functools.cache
def _forward(causal: bool, scale: float, interpret: bool, local: bool = False) -> Any:
    from jax.experimental.custom_partitioning import custom_partitioning

    kernel = _kernel()

    def run(q, k, v, seg):
        out, lse = kernel.mha(q, k, v, seg, sm_scale=scale, causal=causal,
                              interpret=interpret, return_residuals=True)  # fmt: skip
        return out, lse

    if local:  # each device's blocks, in a per-device program
        return run

    fn = custom_partitioning(run)

    def infer(mesh, arg_shapes, result_shape):
        laid = _layouts(mesh, *_split(arg_shapes))
        return laid["bthd"], laid["bht"]

    def partition(mesh, arg_shapes, result_shape):
        laid = _layouts(mesh, *_split(arg_shapes))
        args = (laid["bthd"], laid["bthd"], laid["bthd"], laid["bt"])
        return mesh, run, (laid["bthd"], laid["bht"]), args

    fn.def_partition(infer_sharding_from_operands=infer, partition=partition,
                     sharding_rule="b t h d, b t h d, b t h d, b t -> b t h d, b h t",
                     need_replication_factors=("t", "d"))  # fmt: skip
    return fn


@functools.cache
def _backward(causal: bool, scale: float, interpret: bool, local: bool = False) -> Any:
    from jax.experimental.custom_partitioning import custom_partitioning

    kernel = _kernel()

    def run(q, k, v, seg, out, lse, d_out):
        dq, dk, dv, _ = kernel._mha_backward(
            scale, causal, kernel.BlockSizes.get_default(), "triton", None, 2, None,
            interpret, False, False, (q, k, v, seg, out, lse), d_out,
        )  # fmt: skip
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)

    if local:
        return run

    fn = custom_partitioning(run)

    def infer(mesh, arg_shapes, result_shape):
        laid = _layouts(mesh, *_split(arg_shapes))
        return laid["bthd"], laid["bthd"], laid["bthd"]

    def partition(mesh, arg_shapes, result_shape):
        laid = _layouts(mesh, *_split(arg_shapes))
        four = laid["bthd"]
        args = (four, four, four, laid["bt"], four, laid["bht"], four)
        return mesh, run, (four, four, four), args

    fn.def_partition(
        infer_sharding_from_operands=infer, partition=partition,
        sharding_rule="b t h d, b t h d, b t h d, b t, b t h d, b h t, b t h d "
                      "-> b t h d, b t h d, b t h d",
        need_replication_factors=("t", "d"),
    )  # fmt: skip
    return fn


__all__ = ["BLOCK", "available", "fits", "packed_attention"]
