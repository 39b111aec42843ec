"""Models written in JAX's explicit sharding mode, the way JAX's and Flax's documentation write
them: shardings are part of the arrays' types, and the model says where results go
(``jnp.einsum(..., out_sharding=...)``, ``.at[...].get(out_sharding=...)``,
``jax.sharding.reshard``). Under ``Auto`` mesh axes each of them fails inside JAX.

- :class:`Transformer` (Flax NNX): every einsum of its attention and MLP carries
  ``out_sharding``; the embedding is a gather with ``out_sharding``, as JAX's explicit
  sharding guide asks for indexing; its blocks are a layer stack (so ``pp`` can split it).
  It names logical dimensions, mapped by the run's rules (``shardplug.sharding_of``), so one
  model runs under every strategy.
- :class:`DotReluDot` (Flax NNX): the layer of Flax's "Scale up on multiple devices" guide,
  its parameters annotated with the mesh axis ``"model"`` itself (``out_sharding`` metadata,
  as current Flax names it), the hidden activation placed with ``jax.sharding.reshard`` where
  the guide's Auto-mode version constrains it, and the second product given its
  ``out_sharding`` (both operands split over "model"): it runs on meshes that have
  those axes (``2d``, or ``fsdp+tp`` with ``axis_names={"fsdp": "data"}``).
- :class:`LinenMLP` and :func:`equinox_mlp`: a Linen and an Equinox model with
  ``jax.sharding.reshard`` in their forward pass.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug import stack

S = shardplug.sharding_of
VOCAB, SEQ, EMBED, HEADS, HEAD_DIM, HIDDEN, LAYERS = 32, 16, 32, 8, 4, 64, 2
_init = nnx.initializers.normal(0.05)


def _param(rngs, shape, names):
    return nnx.Param(nnx.with_partitioning(_init, names)(rngs.params(), shape))


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale[None, None]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.scale1 = nnx.Param(jnp.ones((EMBED,)))
        self.wq = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", None))
        self.wk = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", None))
        self.wv = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", None))
        self.wo = _param(rngs, (HEADS, HEAD_DIM, EMBED), ("heads", None, "embed"))
        self.scale2 = nnx.Param(jnp.ones((EMBED,)))
        self.wi = _param(rngs, (EMBED, HIDDEN), ("embed", "mlp"))
        self.wf = _param(rngs, (HIDDEN, EMBED), ("mlp", "embed"))

    def __call__(self, x):
        rows = S(("batch", None, None))
        h = _rms(x, self.scale1[...])
        heads = S(("batch", None, "heads", None))
        q = jnp.einsum("bld,dhk->blhk", h, self.wq[...], out_sharding=heads)
        k = jnp.einsum("bld,dhk->blhk", h, self.wk[...], out_sharding=heads)
        v = jnp.einsum("bld,dhk->blhk", h, self.wv[...], out_sharding=heads)
        o = shardplug.attention(q, k, v, causal=True)
        x = x + jnp.einsum("blhk,hkd->bld", o, self.wo[...], out_sharding=rows)
        h = _rms(x, self.scale2[...])
        u = jnp.einsum("bld,df->blf", h, self.wi[...], out_sharding=S(("batch", None, "mlp")))
        return x + jnp.einsum("blf,fd->bld", nnx.gelu(u), self.wf[...], out_sharding=rows)


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = _param(rngs, (VOCAB, EMBED), ("vocab", "embed"))
        self.position = _param(rngs, (SEQ, EMBED), (None, "embed"))
        self.blocks = stack.nnx_layers(Block, LAYERS, rngs)
        self.unembed = _param(rngs, (EMBED, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        table = jax.sharding.reshard(self.embed[...], P())  # whole: a gather of rows
        x = table.at[tokens].get(out_sharding=S(("batch", None, None)))
        x = x + self.position[...][None, : tokens.shape[1]]
        x = stack.apply(self.blocks, x)
        return jnp.einsum(
            "bld,dv->blv", x, self.unembed[...], out_sharding=S(("batch", None, "vocab"))
        )


def lm_loss(model, batch):
    logits = model(batch["tokens"][:, :-1]).astype(jnp.float32)
    targets = jax.nn.one_hot(batch["tokens"][:, 1:], VOCAB, dtype=jnp.float32)
    loss = -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * targets, axis=-1))
    return loss, {}


def lm_batches(batch=8, seed=0):
    """Sequences of a fixed random permutation walk: learnable next-token structure."""
    key = jax.random.key(seed)
    step = jax.random.permutation(jax.random.key(99), VOCAB)
    i = 0
    while True:
        start = jax.random.randint(jax.random.fold_in(key, i), (batch, 1), 0, VOCAB)
        tokens = [start]
        for _ in range(SEQ):
            tokens.append(step[tokens[-1]])
        yield {"tokens": jax.device_get(jnp.concatenate(tokens, axis=1)).astype("int32")}
        i += 1


class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("model", None))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.sharding.reshard(y, P("data", "model"))
        return jnp.dot(y, self.w2[...], out_sharding=P("data", None))


def regression_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def regression_batches(depth, batch=16, seed=0):
    key = jax.random.key(seed)
    target = jax.random.normal(jax.random.key(7), (depth, depth)) / depth**0.5
    i = 0
    while True:
        x = jax.random.normal(jax.random.fold_in(key, i), (batch, depth))
        yield {"x": jax.device_get(x), "y": jax.device_get(jnp.tanh(x @ target))}
        i += 1


class LinenMLP(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        dense = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        h = nn.relu(nn.Dense(2 * self.depth, use_bias=False, kernel_init=dense)(x))
        h = jax.sharding.reshard(h, S(("batch", "mlp")))
        back = nn.with_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        # both sides split over "mlp"'s axis: the product says where its result goes
        product = functools.partial(jax.lax.dot_general, out_sharding=S(("batch", None)))
        return nn.Dense(self.depth, use_bias=False, kernel_init=back, dot_general=product)(h)


class EquinoxMLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, depth, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(depth, 2 * depth, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(2 * depth, depth, use_bias=False, key=k2)

    def __call__(self, x):
        h = jax.nn.relu(
            jnp.einsum("bi,oi->bo", x, self.up.weight, out_sharding=S(("batch", "mlp")))
        )
        h = jax.sharding.reshard(h, S(("batch", "mlp")))
        return jnp.einsum("bi,oi->bo", h, self.down.weight, out_sharding=S(("batch", None)))


#: Equinox arrays carry no annotations: rules over their paths give the logical names
EQUINOX_RULES = {r"up/weight": ("mlp", "embed"), r"down/weight": ("embed", "mlp")}
