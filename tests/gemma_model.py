"""A small Gemma written as Flax's ``examples/gemma`` writes it, for JAX's explicit sharding mode:
a ``ShardingConfig`` whose ``fsdp_tp_sharding()`` names the mesh axes ``fsdp`` and ``tp`` on
every parameter (``kernel_metadata={"out_sharding": ...}``, ``embedding_metadata``,
``scale_metadata``) and on every product's result (``out_sharding=`` in each call), grouped-query
attention as grouped einsums, a Python list of blocks (no layer stack), the embedding tied
to the output (``attend``). Nothing in it knows shardplug.

``plain_losses`` trains it the way that example does: ``jax.make_mesh(..., ("fsdp", "tp"),
axis_types=Explicit)``, the model built under ``jax.set_mesh``, ``nnx.Optimizer`` and a
``jax.jit`` step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HEADS, KV_HEADS, HEAD, HIDDEN, LAYERS, SEQUENCE, ROWS = (
    256,
    64,
    4,
    2,
    16,
    128,
    2,
    16,
    8,
)
LR = 1e-3


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_cbtkh: P | None = None

    @staticmethod
    def fsdp_tp_sharding(fsdp: str = "fsdp", tp: str = "tp") -> ShardingConfig:
        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(tp),
            act_btd=P(fsdp, None, tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_cbtkh=P(None, fsdp, None, tp, None),
        )


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, shd: ShardingConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.zeros_init()
        self.scale = nnx.Param(init(rngs.params(), (dim,)), out_sharding=shd.rms_norm_weight)

    def __call__(self, x):
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return normed * (1.0 + self.scale[...])


def apply_rope(x, positions, base=10_000):
    half = x.shape[-1] // 2
    timescale = base ** (2 * jnp.arange(half) / x.shape[-1])
    angle = positions[..., None] / timescale
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.shd = shd
        self.q_einsum = nnx.Einsum(
            "BTD,NDH->BTNH", (HEADS, EMBED, HEAD),
            kernel_metadata={"out_sharding": shd.q_weight_ndh}, rngs=rngs,
        )  # fmt: skip
        self.kv_einsum = nnx.Einsum(
            "BTD,CKDH->CBTKH", (2, KV_HEADS, EMBED, HEAD),
            kernel_metadata={"out_sharding": shd.kv_weight_cndh}, rngs=rngs,
        )  # fmt: skip
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD", (HEADS, HEAD, EMBED),
            kernel_metadata={"out_sharding": shd.o_weight_nhd}, rngs=rngs,
        )  # fmt: skip

    def __call__(self, x, positions, mask):
        query = self.q_einsum(x, out_sharding=self.shd.act_btnh)
        key, value = self.kv_einsum(x, out_sharding=self.shd.act_cbtkh)
        query = apply_rope(query, positions) * HEAD**-0.5
        key = apply_rope(key, positions)
        b, t = query.shape[:2]
        grouped = query.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped, key).reshape(b, t, HEADS, t)
        logits = jnp.where(mask[:, :, None, :], logits, -2.3819763e38)
        probs = jax.nn.softmax(logits, axis=-1).reshape(b, t, KV_HEADS, HEADS // KV_HEADS, t)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape(b, t, HEADS, HEAD)
        return self.attn_vec_einsum(encoded, out_sharding=self.shd.act_btd)


class FeedForward(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.shd = shd

        def linear(n_in, n_out, spec):
            return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs,
                              kernel_metadata={"out_sharding": spec})  # fmt: skip

        self.gate_proj = linear(EMBED, HIDDEN, shd.ffw_weight_df)
        self.up_proj = linear(EMBED, HIDDEN, shd.ffw_weight_df)
        self.down_proj = linear(HIDDEN, EMBED, shd.ffw_weight_fd)

    def __call__(self, x):
        gate = nnx.gelu(self.gate_proj(x, out_sharding=self.shd.act_btf))
        up = self.up_proj(x, out_sharding=self.shd.act_btf)
        return self.down_proj(gate * up, out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(EMBED, shd, rngs=rngs)
        self.attn = Attention(shd, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(EMBED, shd, rngs=rngs)
        self.mlp = FeedForward(shd, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class ScaledEmbed(nnx.Embed):
    def __call__(self, x, out_sharding=None):
        return super().__call__(x, out_sharding) * jnp.sqrt(self.features).astype(jnp.float32)


class Gemma(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.shd = shd
        self.embedder = ScaledEmbed(
            VOCAB, EMBED, embedding_metadata={"out_sharding": shd.emb_vd}, rngs=rngs
        )
        self.layers = nnx.List([Block(shd, rngs=rngs) for _ in range(LAYERS)])
        self.final_norm = RMSNorm(EMBED, shd, rngs=rngs)

    def __call__(self, tokens):
        t = tokens.shape[1]
        positions = jnp.arange(t)[None, :]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        x = self.embedder(tokens, out_sharding=self.shd.act_btd)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.embedder.attend(self.final_norm(x), out_sharding=self.shd.act_btd)


def loss_fn(model, batch):
    """The example's cross entropy: one-hot targets against log-softmax (no gather)."""
    logits = model(batch["tokens"])
    targets = jax.nn.one_hot(batch["targets"], logits.shape[-1])
    return -jnp.sum(targets * nnx.log_softmax(logits), axis=-1).mean()


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, VOCAB, (ROWS, SEQUENCE + 1), dtype=np.int32)
        yield {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def plain_losses(steps: int, seed: int = 0, mesh_shape=(4, 2)) -> list[float]:
    """The example's own loop: an explicit (fsdp, tp) mesh, the model built under it."""
    mesh = jax.make_mesh(mesh_shape, ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    data = batches(seed)
    with jax.set_mesh(mesh), jax.numpy_rank_promotion("allow"):
        model = Gemma(ShardingConfig.fsdp_tp_sharding(), rngs=nnx.Rngs(jax.random.key(seed)))
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

        @jax.jit
        def step(graphdef, state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        graphdef, state = nnx.split((model, optimizer))
        rows = jax.sharding.NamedSharding(mesh, P("fsdp"))
        losses = []
        for _ in range(steps):
            batch = jax.device_put(next(data), rows)
            loss, state = step(graphdef, state, batch)
            losses.append(float(loss))
        return losses
