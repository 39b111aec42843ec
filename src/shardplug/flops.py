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
width (causal). Hardware FLOPs are what the compiled step executes (XLA's cost analysis):
they add rematerialisation and any masked attention work, and omit nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A GPT-style decoder: ``layers`` blocks of attention (``width`` wide) and an MLP of
    ``mlp`` hidden units (``mlp_matrices`` weight matrices: 2, or 3 when gated)."""

    layers: int
    width: int
    sequence: int
    vocab: int
    mlp: int | None = None
    mlp_matrices: int = 2
    causal: bool = True

    @property
    def matmul_params(self) -> int:
        """Weights that multiply activations: the blocks' projections and the unembedding."""
        mlp = self.mlp or 4 * self.width
        per_block = 4 * self.width * self.width + self.mlp_matrices * self.width * mlp
        return self.layers * per_block + self.width * self.vocab

    def flops_per_token(self) -> dict[str, float]:
        """Training FLOPs per token: ``{"matmul", "attention", "total"}``."""
        matmul = 6.0 * self.matmul_params
        attention = 12.0 * self.layers * self.sequence * self.width
        if self.causal:
            attention /= 2
        return {"matmul": matmul, "attention": attention, "total": matmul + attention}


__all__ = ["TransformerShape"]


def step_flops(jaxpr: Any, axis_sizes: dict[str, int] | None = None) -> float:
    """FLOPs of a traced step over all devices: 2 per multiply-add of every matrix product
    (``dot_general``) and convolution in ``jaxpr``, a loop's body (``scan``, a layer stack,
    microbatches) counted once per iteration, a per-device program's (``shard_map``) once
    per device, recomputation (``remat``) included. Elementwise work is left out; it is a
    small share of a model dominated by its matrix products.

    XLA's ``cost_analysis()`` counts a loop's body once whatever its trip count, so for a
    stacked model it undercounts by the depth; this count does not.
    """
    import math

    core_jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    sizes = dict(axis_sizes or {})
    total = 0.0
    for eqn in core_jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += (
                2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
            )
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
            per_output = math.prod(rhs[d] for d in spec[1:])
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output
        else:
            times = 1.0
            if name == "scan":
                times = float(eqn.params["length"])
            elif name == "shard_map":
                mesh = eqn.params["mesh"]
                manual = eqn.params.get("manual_axes") or eqn.params.get("axis_names")
                manual = manual or tuple(mesh.axis_names)
                times = float(math.prod(dict(mesh.shape)[a] for a in manual))
            subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
            subs += [
                b for v in eqn.params.values() if isinstance(v, tuple)
                for b in v if hasattr(b, "eqns") or hasattr(b, "jaxpr")
            ]  # fmt: skip
            if name == "cond":  # one branch runs: the costliest
                total += max((step_flops(b, sizes) for b in subs), default=0.0)
            else:
                total += times * sum(step_flops(s, sizes) for s in subs)
    return total
