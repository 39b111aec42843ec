"""FLOPs per token of a decoder-only transformer, counted the way the field counts MFU.

The convention is MaxText's (``calculate_tflops_training_per_device``) and PaLM's (appendix
B): a training step costs 3 forward passes (forward, and a backward of twice the work), and a
forward pass costs 2 FLOPs per multiply-add of

- every matrix product with a weight: the blocks' projections (attention's q, k, v and
  output, the MLP's) and the **unembedding** (the logits); the **input embedding is a
  gather, not a product, and is not counted** (at 125M parameters with a 50k vocabulary it
  is a third of the parameters, and counting it inflates MFU by half);
- attention's two products with the sequence (``q k^T`` and ``scores v``), 2 x 2 x sequence
  x width per token per layer, **halved under a causal mask** (only the lower triangle is
  needed, and flash attention computes only that).

So model FLOPs per token = 6 x (block matrix weights + unembedding) + 6 x layers x sequence x
width (causal). Hardware FLOPs (:func:`step_flops`) are every matrix product the traced
step runs: they add rematerialisation and any masked attention work, and omit nothing.
A model without such a count has its model FLOPs from :func:`model_flops`: 3 x its forward
pass, traced on no strategy, so one model and batch count alike under every strategy.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A GPT-style decoder: ``layers`` blocks of attention (``width`` wide) and an MLP of
    ``mlp`` hidden units (``mlp_matrices`` weight matrices: 2, or 3 when gated), or
    ``experts`` such MLPs of which each token runs ``top_k``."""

    layers: int
    width: int
    sequence: int
    vocab: int
    mlp: int | None = None
    mlp_matrices: int = 2
    causal: bool = True
    #: a mixture of experts' count (0: a dense MLP) and how many each token runs
    experts: int = 0
    top_k: int = 1

    @property
    def matmul_params(self) -> int:
        """Weights that multiply activations: the blocks' projections and the unembedding."""
        mlp = self.mlp or 4 * self.width
        active = self.top_k if self.experts else 1  # the experts a token runs, and its router
        per_block = 4 * self.width * self.width + active * self.mlp_matrices * self.width * mlp
        per_block += self.width * self.experts
        return self.layers * per_block + self.width * self.vocab

    def flops_per_token(self) -> dict[str, float]:
        """Training FLOPs per token: ``{"matmul", "attention", "total"}``."""
        matmul = 6.0 * self.matmul_params
        attention = 12.0 * self.layers * self.sequence * self.width
        if self.causal:
            attention /= 2
        return {"matmul": matmul, "attention": attention, "total": matmul + attention}


__all__ = ["ProductDtypes", "TransformerShape", "model_flops", "product_dtypes", "step_flops"]


def model_flops(adapter: Any, loss_fn: Any, batch: Any, mesh: Any = None) -> float:
    """Model FLOPs of a training step on ``batch`` (its global shapes), for a task that
    gives no ``flops_per_sample``: 3 x the matrix products of the loss's forward pass (the
    backward does twice the forward's work), counted as :func:`step_flops` counts them, on
    the model alone (:func:`shardplug.core.step.trace_loss`): no strategy, so no pipeline's
    idle ticks or extra microbatch work, no recomputation, no per-device program counted once
    per device. One model and batch give one count under every strategy (the strategy's
    step counts differ: the reference transformer of 4 stacked layers, 16 rows, counts 0.67
    GFLOP a step under dp, 2.2 under pp+dp, 4.2 under pp+fsdp; this 0.67 under all three).
    XLA's ``cost_analysis()`` of the lowered forward would count a layer stack's body once,
    not once per layer (0.18 GFLOP for the same step).
    """
    from shardplug.core.step import trace_loss

    return forward_flops(trace_loss(adapter, loss_fn, batch, mesh))


def forward_flops(traced: Any) -> float:
    """:func:`model_flops` of a loss already traced alone (``trace_loss``'s jaxpr)."""
    return 3.0 * step_flops(traced)


def step_flops(jaxpr: Any, axis_sizes: dict[str, int] | None = None) -> float:
    """FLOPs of a traced step over all devices: 2 per multiply-add of every matrix product
    (``dot_general``) and convolution in ``jaxpr``, a loop's body (``scan``, a layer stack,
    microbatches) counted once per iteration, a per-device program's (``shard_map``) once
    per device, recomputation (``remat``) included. Elementwise work is left out; it is a
    small share of a model dominated by its matrix products.

    This is the one count of hardware FLOPs shardplug reports (rows, ``bench``, the GPU
    benchmark). XLA's ``cost_analysis()`` counts a loop's body once whatever its trip count,
    so for a stacked model it undercounts by the depth, and on a GPU it leaves out the fused
    attention kernel's products; this count does neither.
    """
    del axis_sizes  # the mesh travels with each shard_map
    return sum(flops for _, flops in _products(jaxpr))


@dataclasses.dataclass(frozen=True)
class ProductDtypes:
    """The matrix products of a traced step by the dtype they compute in."""

    #: FLOPs per operand dtype ("bfloat16", "float32", or "bfloat16 x float32" when mixed:
    #: JAX's and Flax's attention keep the softmax's probabilities float32 in the backward)
    flops: dict[str, float]
    #: where products of two float32 operands are, largest first: (``file:line
    #: (function)``, FLOPs); the place is the first frame of the caller's code (a model's
    #: layer), not JAX's or Flax's
    float32_sites: list[tuple[str, float]]

    def share(self, dtype: str) -> float:
        """The share of all matrix-product FLOPs whose operands are both ``dtype``."""
        total = sum(self.flops.values())
        return self.flops.get(dtype, 0.0) / total if total else 0.0


def product_dtypes(jaxpr: Any) -> ProductDtypes:
    """What :func:`step_flops` counts, split by the dtype of the products' operands."""
    flops: dict[str, float] = {}
    sites: dict[str, float] = {}
    for eqn, count in _products(jaxpr):
        kinds = sorted({str(v.aval.dtype) for v in eqn.invars[:2]})
        kind = " x ".join(kinds)
        flops[kind] = flops.get(kind, 0.0) + count
        if kinds == ["float32"]:
            where = _caller(eqn)
            sites[where] = sites.get(where, 0.0) + count
    ranked = sorted(sites.items(), key=lambda item: -item[1])
    return ProductDtypes(flops, ranked)


def float32_note(dtypes: ProductDtypes, threshold: float = 0.01) -> str | None:
    """One line naming where a step asked to compute in bfloat16 still computes in float32
    (``threshold`` of its matrix-product FLOPs or more), or None."""
    share = dtypes.share("float32")
    if share < threshold or not dtypes.float32_sites:
        return None
    where = ", ".join(f"{site} ({flops / sum(dtypes.flops.values()):.0%})"
                      for site, flops in dtypes.float32_sites[:3])  # fmt: skip
    return (
        f"bf16 was asked for, but {share:.0%} of the matrix-product FLOPs compute in float32, "
        f"at {where}: a float32 operand there (a layer built with dtype=float32, or a float32 "
        "array of the model's own: cast it to shardplug.compute_dtype()) keeps them float32"
    )


def warn_if_float32(jaxpr: Any, precision: str) -> None:
    """Warn (:class:`shardplug.ShardplugWarning`) when a step asked to compute in bfloat16
    runs a share of its matrix products in float32, naming where."""
    from shardplug.core.precision import PRECISIONS

    if PRECISIONS.get(precision) is not None and (note := float32_note(product_dtypes(jaxpr))):
        import warnings

        from shardplug.errors import ShardplugWarning

        warnings.warn(note, ShardplugWarning, stacklevel=3)


def _products(jaxpr: Any, times: float = 1.0) -> list[tuple[Any, float]]:
    """Every ``dot_general`` and convolution of ``jaxpr`` with its FLOPs, loops multiplied."""
    import math

    out: list[tuple[Any, float]] = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            per = math.prod(lhs[d] for d in contract)
            out.append((eqn, times * 2.0 * math.prod(eqn.outvars[0].aval.shape) * per))
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
            per = math.prod(rhs[d] for d in spec[1:])
            out.append((eqn, times * 2.0 * math.prod(eqn.outvars[0].aval.shape) * per))
        elif name == "ragged_dot_general":  # a grouped product: each row meets one group
            numbers = eqn.params["ragged_dot_dimension_numbers"]
            (contract, _), _ = numbers.dot_dimension_numbers
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            groups = math.prod(rhs[d] for d in numbers.rhs_group_dimensions)
            per = math.prod(lhs[d] for d in contract) * groups
            out.append((eqn, times * 2.0 * math.prod(lhs) * math.prod(rhs) / per))
        elif name.startswith(("dot_product_attention_fwd", "dot_product_attention_bwd")):
            out.append((eqn, times * _fused_attention(eqn)))
        else:
            inner = times
            if name == "scan":
                inner *= float(eqn.params["length"])
            elif name == "shard_map":
                mesh = eqn.params["mesh"]
                manual = eqn.params.get("manual_axes") or eqn.params.get("axis_names")
                manual = manual or tuple(mesh.axis_names)
                inner *= float(math.prod(dict(mesh.shape)[a] for a in manual))
            subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
            subs += [
                b for v in eqn.params.values() if isinstance(v, tuple)
                for b in v if hasattr(b, "eqns") or hasattr(b, "jaxpr")
            ]  # fmt: skip
            found = [_products(sub, inner) for sub in subs]
            if name == "cond":  # one branch runs: the costliest
                found = [max(found, key=lambda f: sum(c for _, c in f), default=[])]
            for part in found:
                out.extend(part)
    return out


def _fused_attention(eqn: Any) -> float:
    """FLOPs of cuDNN's fused attention (a custom call, no ``dot_general`` in sight).

    Forward: ``q k^T`` and ``p v``, 2 x 2 x batch x heads x q_len x kv_len x head_dim.
    Backward (flash attention): the scores recomputed, then ``dv``, ``dp``, ``dq``, ``dk``: 5
    products. A causal mask halves both: the kernel skips the blocks above the diagonal.
    """
    import math

    query, key = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if int(eqn.params.get("layout", 0)) == 1:  # (batch, heads, seq, head_dim)
        (b, n, t, h), s = query, key[2]
    else:  # (batch, seq, heads, head_dim)
        (b, t, n, h), s = query, key[1]
    products = 5 if "bwd" in eqn.primitive.name else 2
    flops = products * 2.0 * math.prod((b, n, t, s, h))
    causal = "CAUSAL" in str(eqn.params.get("mask_type", ""))
    return flops / 2 if causal else flops


_LIBRARIES = ("/jax/", "/jaxlib/", "/flax/", "/equinox/", "/optax/", "/shardplug/core/",
              "/shardplug/stack.py", "/shardplug/trainer.py", "/lib/python3")  # fmt: skip


def _caller(eqn: Any) -> str:
    """``file:line (function)`` of the first frame of ``eqn``'s trace outside the libraries."""
    traceback = getattr(eqn.source_info, "traceback", None)
    frames = list(getattr(traceback, "frames", None) or [])
    for frame in frames:
        if not any(part in frame.file_name for part in _LIBRARIES):
            name = frame.file_name.rsplit("/", 1)[-1]
            return f"{name}:{frame.line_num} ({frame.function_name})"
    if frames:
        frame = frames[0]
        return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.line_num} ({frame.function_name})"
    return "unknown"
