"""A model written for JAX's explicit sharding mode, for the conformance suite: a stack of
residual blocks over a sequence (attention of :data:`HEADS` heads through
:func:`shardplug.attention`, then an MLP)
whose products say where their results go (``jnp.einsum(...,
out_sharding=shardplug.sharding_of(...))``), so it fails on ``Auto`` mesh axes and runs on
``Explicit`` ones under any strategy: its blocks are a layer stack (``pp`` splits it) and its
batch has a sequence (``cp`` splits that). :class:`ExpertNet` is the same with each MLP a
routed mixture of :data:`EXPERTS` experts (:mod:`shardplug.moe`), for plugins that place
experts."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardplug import moe, stack
from shardplug.core.context import sharding_of
from shardplug.core.operations.attention import attention

DEPTH, HIDDEN, LAYERS, ROWS, LENGTH, HEADS = 16, 64, 8, 16, 16, 4
EXPERTS, TOP_K = 4, 2
_init = nnx.initializers.lecun_normal()


def _norm(x: jax.Array) -> jax.Array:
    """RMS normalisation of each token (pre-norm: the residual stream stays in scale)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _attend(x: jax.Array) -> jax.Array:
    """Causal self-attention of the sequence's (normalised) tokens, in :data:`HEADS` heads
    (a parallelism that splits heads has several to split)."""
    heads = _norm(x).reshape(*x.shape[:2], HEADS, DEPTH // HEADS)
    return attention(heads, heads, heads, causal=True).reshape(x.shape)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        up, down = ("embed", "mlp"), ("mlp", "embed")
        self.up = nnx.Param(nnx.with_partitioning(_init, up)(rngs.params(), (DEPTH, HIDDEN)))
        self.down = nnx.Param(nnx.with_partitioning(_init, down)(rngs.params(), (HIDDEN, DEPTH)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + _attend(x)
        hidden = sharding_of(("batch", "length", "mlp"))
        h = jnp.einsum("bld,df->blf", _norm(x), self.up[...], out_sharding=hidden)
        out = sharding_of(("batch", "length", None))
        return x + jnp.einsum("blf,fd->bld", jax.nn.relu(h), self.down[...], out_sharding=out)


class ResidualNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = stack.nnx_layers(Block, LAYERS, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return stack.apply(self.blocks, x)


class ExpertBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def param(names, shape):
            return nnx.Param(nnx.with_partitioning(_init, names)(rngs.params(), shape))

        self.router = param(("embed", None), (DEPTH, EXPERTS))
        self.up = param(("expert", "embed", "mlp"), (EXPERTS, DEPTH, HIDDEN))
        self.down = param(("expert", "mlp", "embed"), (EXPERTS, HIDDEN, DEPTH))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, moe.Tally]:
        x = x + _attend(x)
        rows = _norm(x).reshape(-1, DEPTH)
        logits = jnp.einsum("td,de->te", rows, self.router[...], out_sharding=sharding_of(
            ("batch", None)))  # fmt: skip
        routing = moe.route(logits, TOP_K)
        out, stats = moe.routed_experts(rows, routing, self.up[...], self.down[...])
        return x + out.reshape(x.shape), moe.tally(logits, routing, stats)


class ExpertNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = stack.nnx_layers(ExpertBlock, LAYERS // 4, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, moe.Tally]:
        return stack.apply(self.blocks, x)


def loss_fn(model: ResidualNet | ExpertNet, batch: dict[str, jax.Array]) -> jax.Array:
    out = model(batch["x"])
    if isinstance(out, tuple):  # ExpertNet: and its balancing loss
        balance = moe.summary(out[1])["moe_balance_loss"]
        return jnp.mean((out[0] - batch["y"]) ** 2) + 0.01 * balance
    return jnp.mean((out - batch["y"]) ** 2)


def batches(seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of a fixed smooth target over sequences: the loss can fall."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(DEPTH, DEPTH)).astype(np.float32) / DEPTH**0.5
    while True:
        x = rng.normal(size=(ROWS, LENGTH, DEPTH)).astype(np.float32)
        yield {"x": x, "y": np.tanh(np.cumsum(x, axis=1) @ target / LENGTH**0.5)}
