"""Matrix products in float8: operands scaled into float8's range, multiplied as float8.

:func:`float8_dot_general` is ``jax.lax.dot_general`` computed the way Hopper's float8
tensor cores compute it, and the way torchtitan's and MaxText's float8 training recipes
do: the forward product of the activations and the weight in ``float8_e4m3fn`` (3 mantissa
bits, range +-448), the backward products with the output's gradient in ``float8_e5m2``
(2 mantissa bits, range +-57344: gradients span more magnitudes than they need digits).
Each operand is scaled before it is cast so that its largest magnitude lands at float8's
largest (``amax`` scaling, computed from the tensor itself in the step that uses it:
dynamic, no history to keep or checkpoint), and the product is scaled back after:

- ``scaling="tensor"``: one scale per operand (torchtitan's tensorwise recipe, Transformer
  Engine's default): the fastest, and a single outlier coarsens every other value;
- ``scaling="row"``: one scale per row along the dimensions the product keeps (each token's
  activations, each output unit's weights; torchtitan's rowwise): an outlier costs its own
  row's precision alone.

The float8 values enter ``dot_general`` themselves, with the output dtype asked of the
product (``preferred_element_type``): XLA's GPU compiler then runs a float8 GEMM (a Triton
GEMM fusion or cuBLASLt's float8 matmul, both of float8 operands). The pattern that casts
float8 back to bfloat16 before the product (dequantize, then multiply) is folded away by
the compiler into a bfloat16 GEMM: the known trap, which this module never writes.

Errors, relative to a float32 product (measured in ``tests/test_float8.py`` for unit-normal
operands and 256-term contractions): the forward product about 3% (each e4m3 operand
rounds by at most 1/16, and the errors of the terms partly cancel), the gradients about
6% (e5m2 rounds by at most 1/8). A non-finite operand makes its scale non-finite, so the
product is NaN where it is used and the step's loss says so (``--on-nonfinite``); zeros
scale by one.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from shardplug.errors import ConfigError

#: device kinds whose tensor cores multiply float8 (Hopper, Ada Lovelace, Blackwell)
FLOAT8_DEVICES = re.compile(r"H100|H200|H800|H20\b|GH200|L4\b|L40|RTX 40|B100|B200|GB200|RTX 50")
FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2
SCALINGS = ("tensor", "row")


def float8_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, *, scaling: str = "tensor",
                       preferred_element_type: Any = None,
                       precision: Any = None) -> Any:  # fmt: skip
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` with float8 operands (see the
    module): forward in e4m3, the gradients' products with the output's gradient in e5m2.
    ``preferred_element_type``: the output's dtype (default: the operands' promoted)."""
    if scaling not in SCALINGS:
        raise ConfigError(f"float8: scaling must be one of {', '.join(SCALINGS)}, got "
                          f"{scaling!r}")  # fmt: skip
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    (lc, rc), (lb, rb) = dimension_numbers
    numbers = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    del precision  # float8's own: the tensor cores accumulate in float32
    return _product(lhs, rhs, numbers, scaling, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _product(lhs, rhs, numbers, scaling, out_dtype):
    return scaled_product(lhs, FORWARD, rhs, FORWARD, numbers, scaling, out_dtype)


def _product_fwd(lhs, rhs, numbers, scaling, out_dtype):
    return _product(lhs, rhs, numbers, scaling, out_dtype), (lhs, rhs)


def _product_bwd(numbers, scaling, out_dtype, residuals, g):
    lhs, rhs = residuals
    (lc, rc), (lb, rb) = numbers
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    nb = len(lb)
    g_batch = tuple(range(nb))
    g_lhs_free = tuple(range(nb, nb + len(lf)))
    g_rhs_free = tuple(range(nb + len(lf), g.ndim))
    # d lhs = g . rhs over rhs's free dimensions: (batch, lhs free, rhs contracting)
    d_lhs = scaled_product(g, BACKWARD, rhs, FORWARD,
                           ((g_rhs_free, tuple(rf)), (g_batch, tuple(rb))), scaling,
                           lhs.dtype)  # fmt: skip
    d_lhs = jnp.transpose(d_lhs, _inverse([*lb, *lf, *[lc[list(rc).index(r)] for r in sorted(rc)]]))
    # d rhs = lhs . g over lhs's free dimensions: (batch, lhs contracting, rhs free)
    d_rhs = scaled_product(lhs, FORWARD, g, BACKWARD,
                           ((tuple(lf), g_lhs_free), (tuple(lb), g_batch)), scaling,
                           rhs.dtype)  # fmt: skip
    d_rhs = jnp.transpose(d_rhs, _inverse([*rb, *[rc[list(lc).index(d)] for d in sorted(lc)],
                                           *rf]))  # fmt: skip
    return d_lhs, d_rhs


_product.defvjp(_product_fwd, _product_bwd)


def _inverse(permutation: list[int]) -> list[int]:
    out = [0] * len(permutation)
    for i, p in enumerate(permutation):
        out[p] = i
    return out


def scaled_product(a: Any, a_dtype: Any, b: Any, b_dtype: Any, numbers: Any, scaling: str,
                   out_dtype: Any) -> Any:  # fmt: skip
    """``dot_general(a, b, numbers)`` of ``a`` cast to ``a_dtype`` and ``b`` to ``b_dtype``,
    each scaled into its range first (per tensor, or per row: along the dimensions the
    product keeps), the product scaled back: float8 operands into the product itself."""
    (ac, bc), (ab, bb) = numbers
    qa, sa = _scaled(a, a_dtype, ac if scaling == "row" else None)
    qb, sb = _scaled(b, b_dtype, bc if scaling == "row" else None)
    out = jax.lax.dot_general(qa, qb, numbers, preferred_element_type=jnp.float32)
    if scaling == "tensor":
        return (out * (sa * sb)).astype(out_dtype)
    af = [d for d in range(a.ndim) if d not in ac and d not in ab]
    bf = [d for d in range(b.ndim) if d not in bc and d not in bb]
    # each scale laid out as the product's dimensions: (batch, a's free, b's free)
    sa = jnp.transpose(sa, [*_kept(ab, ac, a.ndim), *_kept(af, ac, a.ndim)])
    sa = sa.reshape(*sa.shape, *([1] * len(bf)))
    sb = jnp.transpose(sb, [*_kept(bb, bc, b.ndim), *_kept(bf, bc, b.ndim)])
    sb = sb.reshape(*sb.shape[: len(bb)], *([1] * len(af)), *sb.shape[len(bb) :])
    return (out * sa * sb).astype(out_dtype)


def _kept(dims: Any, dropped: Any, ndim: int) -> list[int]:
    """The positions of ``dims`` once ``dropped`` are taken out of ``ndim`` dimensions."""
    left = [d for d in range(ndim) if d not in dropped]
    return [left.index(d) for d in dims]


def _scaled(x: Any, dtype: Any, over: Any) -> tuple[Any, Any]:
    """``x`` scaled so that its largest magnitude (over ``over``'s dimensions, each row
    its own; None: the whole tensor) is ``dtype``'s largest, cast; and the scale back
    (the row scales with ``over`` dropped)."""
    limit = float(jnp.finfo(dtype).max)
    wide = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wide), axis=None if over is None else tuple(over), keepdims=True)
    up = jnp.where(amax > 0, limit / amax, 1.0)  # a NaN or infinite amax stays non-finite
    up = jnp.where(jnp.isfinite(amax), up, jnp.nan)
    q = jnp.clip(wide * up, -limit, limit).astype(dtype)
    back = 1.0 / up
    if over is None:
        return q, back.reshape(())
    return q, jnp.squeeze(back, axis=tuple(over))


def gemms(hlo_text: str) -> list[tuple[str, str]]:
    """The matrix products of a GPU's compiled program (``compiled.as_text()``), each as
    its two operands' dtypes where the product runs: the ``dot`` inside a Triton GEMM
    fusion (which may take float8 parameters and widen them first), a cuBLAS call's."""
    found = []
    blocks = re.findall(r"^(%\S*gemm_fusion\S* \((.*?)\) ->.*?^})", hlo_text, re.M | re.S)
    for body, params in blocks:
        types = dict(re.findall(r"(\S+): (\w+)\[", params))
        types.update(re.findall(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[", body, re.M))
        for lhs, rhs in re.findall(r" dot\(%(\S+), %(\S+)\)", body):
            found.append((types.get(lhs, "?"), types.get(rhs, "?")))
    entry = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[", hlo_text, re.M))
    for lhs, rhs in re.findall(r"custom-call\(%(\S+), %(\S+?)[,)].*custom_call_target=\"__cublas",
                               hlo_text):  # fmt: skip
        found.append((entry.get(lhs, "?"), entry.get(rhs, "?")))
    return found


def relative_error(got: Any, want: Any) -> float:
    """``|got - want| / |want|`` in the Frobenius norm (0 for two zero arrays)."""
    want = jnp.asarray(want, jnp.float32)
    norm = float(jnp.linalg.norm(want))
    diff = float(jnp.linalg.norm(jnp.asarray(got, jnp.float32) - want))
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


__all__ = ["BACKWARD", "FLOAT8_DEVICES", "FORWARD", "SCALINGS", "float8_dot_general", "gemms",
           "relative_error", "scaled_product"]
