"""Tokens per second and model FLOPs utilisation of a GPT-style transformer on one GPU.

``python benchmarks/gpu_mfu.py --size 125m`` (or ``350m``, ``1b``) trains a decoder-only
transformer in bfloat16 (float32 master weights and Adam state) with shardplug's ``dp`` on one
device and prints tokens/s, model and hardware TFLOP/s, and MFU over the chip's dense
bfloat16 peak (989 TFLOP/s for H100 SXM and H200; ``--peak-tflops`` for others).

Model FLOPs are counted as MaxText counts them (:mod:`shardplug.flops`): 6 x the matrix
weights of the blocks and the unembedding per token (the input embedding is a gather, not
counted), plus causal attention at half of 12 x layers x sequence x width. Hardware FLOPs
are the compiled step's own count (XLA's cost analysis), rematerialisation included.
``--remat none|dots|full`` chooses the blocks' rematerialisation. ``--size smoke`` runs a
tiny model on any backend, to check the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SIZES = {  # layers, width, heads, sequence, batch, vocabulary
    "125m": (12, 768, 12, 1024, 32, 50304),
    "350m": (24, 1024, 16, 1024, 16, 50304),
    "1b": (16, 2048, 16, 1024, 16, 50304),
    "smoke": (2, 64, 4, 64, 8, 512),
}
PEAKS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


REMAT = ("none", "dots", "full")


def gpt(layers: int, width: int, heads: int, seq: int, vocab: int, remat: str = "none") -> Any:
    """A pre-norm GPT (learned positions, tied-free unembedding), in Flax NNX."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    init = nnx.initializers.normal(0.02)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(width, rngs=rngs)
            self.qkv = nnx.Linear(width, 3 * width, use_bias=False, kernel_init=init, rngs=rngs)
            self.out = nnx.Linear(width, width, use_bias=False, kernel_init=init, rngs=rngs)
            self.norm2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, use_bias=False, kernel_init=init, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, use_bias=False, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            b, s, _ = x.shape
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
            q, k, v = (t.reshape(b, s, heads, width // heads) for t in (q, k, v))
            attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.reshape(b, s, width))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, width, embedding_init=init, rngs=rngs)
            self.position = nnx.Param(init(rngs.params(), (seq, width)))
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.unembed = nnx.Linear(width, vocab, use_bias=False, kernel_init=init, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.position[...][None, : tokens.shape[1]]
            for block in self.blocks:
                x = _remat(block, remat)(x)
            return self.unembed(self.norm(x))

    return GPT


def _remat(block: Any, policy: str) -> Any:
    """The block, its activations kept (``none``), all recomputed in the backward pass
    (``full``), or all but the matrix products' outputs recomputed (``dots``)."""
    import jax
    from flax import nnx

    if policy == "none":
        return block
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    run = nnx.remat(lambda b, x: b(x), policy=saveable if policy == "dots" else None)
    return lambda x: run(block, x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="125m")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--remat", choices=REMAT, default="none")
    args = parser.parse_args(argv)

    import jax
    import numpy as np
    import optax

    import shardplug

    layers, width, heads, seq, batch, vocab = SIZES[args.size]
    batch = args.batch or batch
    model = shardplug.from_nnx(gpt(layers, width, heads, seq, vocab, args.remat))

    def loss_fn(model, batch):
        logits = model(batch["tokens"]).astype("float32")
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    trainer = shardplug.Trainer(
        model,
        loss_fn=loss_fn,
        optimizer=optax.adamw(3e-4, weight_decay=0.1),
        strategy="dp",
        devices=1,
        precision=args.precision,
        grad_accum=args.grad_accum,
        log_every=args.steps,
    )
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
        batches.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})

    def feed(n):
        return (batches[i % len(batches)] for i in range(n))

    trainer.fit(feed(3), 3)  # compile and warm up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.fit(feed(args.steps), args.steps)
        times.append((time.perf_counter() - start) / args.steps)
    step = statistics.median(times)

    from shardplug.flops import TransformerShape

    params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    counted = TransformerShape(layers, width, seq, vocab).flops_per_token()
    flops_per_token = counted["total"]
    tokens_per_second = batch * seq / step
    cost = trainer.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hardware_per_step = float(cost.get("flops", 0.0)) if cost else 0.0
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    peak = (args.peak_tflops * 1e12) if args.peak_tflops else next(
        (v for k, v in PEAKS.items() if k in kind), None
    )  # fmt: skip
    result = {
        "size": args.size,
        "params": params,
        "device": kind,
        "batch": batch,
        "sequence": seq,
        "precision": args.precision,
        "step_seconds": step,
        "tokens_per_second": tokens_per_second,
        "remat": args.remat,
        "model_flops_per_token": flops_per_token,
        "model_flops_per_token_parts": counted,
        "model_tflops_per_second": flops_per_token * tokens_per_second / 1e12,
        "hardware_tflops_per_second": hardware_per_step / step / 1e12,
        "mfu": None if peak is None else flops_per_token * tokens_per_second / peak,
        "loss": trainer.history[-1]["loss"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
