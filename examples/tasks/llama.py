"""A Llama-2-shaped decoder in Flax NNX, as a shardplug task: will 7B fit on 8 GPUs?

    shardplug explain --task examples/tasks/llama.py:llama2_7b --strategy fsdp \
        --device-memory 80GB
    shardplug recommend --task examples/tasks/llama.py:llama2_7b --device-memory 80GB
    shardplug train --task examples/tasks/llama.py:tiny --strategy fsdp+tp --steps 20

``llama2_7b`` has Llama 2 7B's shape (32 layers, width 4096, 32 heads, SwiGLU MLP of 11008,
vocabulary 32000, sequence 4096: 6.74B parameters, float32 here, trained with AdamW). The
model is given to ``from_nnx`` as a function that builds it, so ``explain`` and
``recommend`` compile it on abstract arrays and allocate no parameter. ``tiny`` is the same
code at a size that trains on a laptop. The data are random tokens: this file is about
shapes and memory, not about learning English.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplug
from shardplug import moe, stack
from shardplug.core.flops import TransformerShape


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 32
    width: int = 4096
    heads: int = 32
    mlp: int = 11008
    vocab: int = 32000
    sequence: int = 4096
    batch: int = 8
    remat: str = "full"  # keep only each layer's input for the backward pass
    experts: int = 0  # > 0: each MLP a routed mixture of this many (shardplug.moe)
    top_k: int = 2


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), names)
    return nnx.Param(init(rngs.params(), shape))


class RMSNorm(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))(
            rngs.params(), (width,)))  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6)
        return (normed * self.scale[...][(None,) * (x.ndim - 1)]).astype(x.dtype)


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of (batch, seq, heads, head_dim)."""
    seq, dim = x.shape[1], x.shape[-1]
    freq = 1.0 / (10000 ** (jnp.arange(0, dim, 2) / dim))
    angle = jnp.arange(seq)[:, None] * freq[None, :]  # float32: positions up to 4096 and more
    cos, sin = (f(angle)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    even, odd = x[..., 0::2], x[..., 1::2]  # bfloat16 under --precision bf16, like x
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], -1)
    return rotated.reshape(x.shape)


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        head = c.width // c.heads
        self.attention_norm = RMSNorm(c.width, rngs)
        self.wq = _param(rngs, (c.width, c.heads, head), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (c.width, c.heads, head), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (c.width, c.heads, head), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (c.heads, head, c.width), ("heads", "kv", "embed"))
        self.mlp_norm = RMSNorm(c.width, rngs)
        self.top_k = c.top_k
        if c.experts:  # stacked experts, their leading dimension named "expert" (ep splits it)
            self.router = _param(rngs, (c.width, c.experts), ("embed", None))
            shape, names = (c.experts, c.width, c.mlp), ("expert", "embed", "mlp")
            self.experts_gate = _param(rngs, shape, names)
            self.experts_up = _param(rngs, shape, names)
            self.experts_down = _param(
                rngs, (c.experts, c.mlp, c.width), ("expert", "mlp", "embed")
            )
            return
        self.w_gate = _param(rngs, (c.width, c.mlp), ("embed", "mlp"))
        self.w_up = _param(rngs, (c.width, c.mlp), ("embed", "mlp"))
        self.w_down = _param(rngs, (c.mlp, c.width), ("mlp", "embed"))

    def experts(self, h: jax.Array) -> tuple[jax.Array, dict]:
        """Mixtral's MLP: each token through its top-k SwiGLU experts; and the routing's tally
        (sums the stack carries), for the losses and the rows."""
        rows = h.reshape(-1, h.shape[-1])
        logits = rows @ self.router[...]
        routing = moe.route(logits, self.top_k)
        out, stats = moe.routed_experts(
            rows, routing, self.experts_up[...], self.experts_down[...],
            w_gate=self.experts_gate[...],
        )  # fmt: skip
        return out.reshape(h.shape), moe.tally(logits, routing, stats)

    def __call__(self, x: jax.Array):
        h = self.attention_norm(x)
        q = rope(jnp.einsum("bse,ehd->bshd", h, self.wq[...]))
        k = rope(jnp.einsum("bse,ehd->bshd", h, self.wk[...]))
        v = jnp.einsum("bse,ehd->bshd", h, self.wv[...])
        attended = shardplug.attention(q, k, v, causal=True)  # cuDNN's kernel on a GPU
        x = x + jnp.einsum("bshd,hde->bse", attended, self.wo[...])
        h = self.mlp_norm(x)
        if hasattr(self, "router"):
            out, aux = self.experts(h)
            return x + out, aux
        return x + (nnx.silu(h @ self.w_gate[...]) * (h @ self.w_up[...])) @ self.w_down[...]


class Llama(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.embed = _param(rngs, (c.vocab, c.width), ("vocab", "embed"))
        self.blocks = stack.nnx_layers(lambda r: Block(c, r), c.layers, rngs)
        self.norm = RMSNorm(c.width, rngs)
        self.unembed = _param(rngs, (c.width, c.vocab), ("embed", "vocab"))
        self.remat, self.layers = c.remat, c.layers

    def __call__(self, tokens: jax.Array):
        """The logits; with experts, ``(logits, tallies)``, one tally a layer."""
        x = self.embed[...][tokens]
        x = stack.apply(self.blocks, x, remat=self.remat)
        if isinstance(x, tuple):
            return self.norm(x[0]) @ self.unembed[...], x[1]
        return self.norm(x) @ self.unembed[...]


def loss_fn(model: Llama, batch: dict[str, jax.Array]):
    out = model(batch["tokens"])
    logits, aux = out if isinstance(out, tuple) else (out, None)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    ).mean()
    if aux is None:
        return loss
    mean = moe.summary(aux)  # each layer's losses and load, on average
    return loss + 0.01 * mean["moe_balance_loss"] + 0.001 * mean["moe_z_loss"], mean


def random_tokens(c: Config, seed: int = 0):
    """Endless batches of ``sequence`` random tokens and their next tokens, shifted here,
    before any split of the sequence (under ``cp`` a shard's last target is the next
    shard's first token)."""
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, c.vocab, (c.batch, c.sequence + 1), dtype=np.int32)
        yield {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def task_of(c: Config, name: str) -> shardplug.Task:
    shape = TransformerShape(layers=c.layers, width=c.width, sequence=c.sequence,
                             vocab=c.vocab, mlp=c.mlp, mlp_matrices=3, experts=c.experts,
                             top_k=c.top_k)  # fmt: skip
    return shardplug.Task(
        adapter=shardplug.from_nnx(lambda rngs: Llama(c, rngs)),  # built lazily, in shardings
        loss_fn=loss_fn,
        optimizer=optax.adamw(3e-4, weight_decay=0.1),
        data=lambda: random_tokens(c),
        name=name,
        flops_per_sample=shape.flops_per_token()["total"] * c.sequence,
    )


def llama2_7b(sequence: int = 4096, batch_size: int = 8) -> shardplug.Task:
    """Llama 2 7B's shape; ``--sequence`` and ``--batch-size`` (and ``recommend
    --longest-sequence``) size it."""
    return task_of(Config(sequence=sequence, batch=batch_size), "llama2-7b")


def mixtral_8x7b(sequence: int = 4096, batch_size: int = 8) -> shardplug.Task:
    """Mixtral 8x7B's shape (32 layers, width 4096, 32 heads, 8 SwiGLU experts of 14336 and
    top-2 routing, vocabulary 32000: 47.5B parameters, 13.7B active a token; Mixtral's
    grouped-query attention is full multi-head attention here), planned by ``explain``
    with ``--strategy fsdp+ep``."""
    c = Config(mlp=14336, experts=8, top_k=2, sequence=sequence, batch=batch_size)
    return task_of(c, "mixtral-8x7b")


def tiny_moe(sequence: int = 32, batch_size: int = 16) -> shardplug.Task:
    """The tiny model with 4 experts, top-2: trains under ``ep`` in seconds."""
    c = Config(layers=2, width=64, heads=4, mlp=172, vocab=256, sequence=sequence,
               batch=batch_size, experts=4)  # fmt: skip
    return task_of(c, "tiny-moe")


def long_context(sequence: int = 1024, batch_size: int = 8) -> shardplug.Task:
    """The tiny model at a sequence of 1024, for context parallelism (``--strategy dp+cp``)."""
    c = Config(layers=2, width=64, heads=4, mlp=172, vocab=256, sequence=sequence,
               batch=batch_size, remat="none")  # fmt: skip
    return task_of(c, "long-context")


def tiny(sequence: int = 32, batch_size: int = 16) -> shardplug.Task:
    c = Config(layers=2, width=64, heads=4, mlp=172, vocab=256, sequence=sequence,
               batch=batch_size)  # fmt: skip
    return task_of(c, "tiny")
