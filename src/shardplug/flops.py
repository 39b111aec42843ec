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
