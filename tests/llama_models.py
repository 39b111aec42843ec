"""A Llama-style language model with grouped-query attention, written three times the way each
framework's users write one (stock layers, the framework's own initialisers and partition
metadata), and a plain single-device ``jax.jit`` loop for each, the yardstick.

4 query heads share 2 key/value heads (Llama 2 70B, Llama 3, Mistral: grouped-query
attention), RoPE on queries and keys, SwiGLU MLP, RMSNorm before each sub-layer, blocks in a
layer stack (``shardplug.stack``, so ``pp`` can split them). The loss feeds the model
``tokens[:, :-1]`` and scores ``tokens[:, 1:]``: a sequence one shorter than the batch's.
``kv_heads=1`` makes it multi-query attention.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplug
from shardplug import stack

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD, MLP, LAYERS = 64, 32, 4, 2, 8, 64, 2
SEQUENCE, ROWS, LR = 32, 8, 3e-3


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``(batch, sequence, heads, head_dim)``, Llama's halves."""
    positions = jnp.arange(x.shape[1])
    freq = 1.0 / (10000 ** (jnp.arange(0, x.shape[-1], 2) / x.shape[-1]))
    angle = positions[:, None] * freq[None, :]
    cos, sin = (f(angle)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], -1)


def attend(q, k, v, heads: int, kv_heads: int) -> jax.Array:
    """Projections ``(batch, sequence, heads x head_dim)`` to attention's output, same shape."""
    b, s, _ = q.shape
    q = rope(q.reshape(b, s, heads, HEAD))
    k = rope(k.reshape(b, s, kv_heads, HEAD))
    out = shardplug.attention(q, k, v.reshape(b, s, kv_heads, HEAD), causal=True)
    return out.reshape(b, s, heads * HEAD)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]
    ).mean()


def batches(seed: int = 0, sequence: int = SEQUENCE, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    while True:
        yield {"tokens": rng.integers(0, VOCAB, (rows, sequence), dtype=np.int32)}


# -- Flax NNX --------------------------------------------------------------------------------


def _linear(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, rngs=rngs)


class NnxBlock(nnx.Module):
    def __init__(self, kv_heads: int, rngs: nnx.Rngs):
        self.kv_heads = kv_heads
        self.attention_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.q = _linear(WIDTH, HEADS * HEAD, ("embed", "heads"), rngs)
        self.k = _linear(WIDTH, kv_heads * HEAD, ("embed", "heads"), rngs)
        self.v = _linear(WIDTH, kv_heads * HEAD, ("embed", "heads"), rngs)
        self.o = _linear(HEADS * HEAD, WIDTH, ("heads", "embed"), rngs)
        self.mlp_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.gate = _linear(WIDTH, MLP, ("embed", "mlp"), rngs)
        self.up = _linear(WIDTH, MLP, ("embed", "mlp"), rngs)
        self.down = _linear(MLP, WIDTH, ("mlp", "embed"), rngs)

    def __call__(self, x):
        h = self.attention_norm(x)
        x = x + self.o(attend(self.q(h), self.k(h), self.v(h), HEADS, self.kv_heads))
        h = self.mlp_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class NnxLlama(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, kv_heads: int = KV_HEADS):
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=init, rngs=rngs)
        self.blocks = stack.nnx_layers(lambda r: NnxBlock(kv_heads, r), LAYERS, rngs)
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.head = _linear(WIDTH, VOCAB, ("embed", "vocab"), rngs)

    def __call__(self, tokens):
        return self.head(self.norm(stack.apply(self.blocks, self.embed(tokens))))


def nnx_loss(model, batch):
    return next_token_loss(model(batch["tokens"][:, :-1]), batch["tokens"])


# -- Flax Linen ------------------------------------------------------------------------------


def _dense(features: int, names: tuple) -> nn.Dense:
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return nn.Dense(features, use_bias=False, kernel_init=init)


class LinenBlock(nn.Module):
    kv_heads: int = KV_HEADS

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm()(x)
        q, k, v = (_dense(n * HEAD, ("embed", "heads"))(h)
                   for n in (HEADS, self.kv_heads, self.kv_heads))  # fmt: skip
        x = x + _dense(WIDTH, ("heads", "embed"))(attend(q, k, v, HEADS, self.kv_heads))
        h = nn.RMSNorm()(x)
        gate, up = _dense(MLP, ("embed", "mlp"))(h), _dense(MLP, ("embed", "mlp"))(h)
        return x + _dense(WIDTH, ("mlp", "embed"))(nn.silu(gate) * up)


class LinenLlama(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        x = nn.Embed(VOCAB, WIDTH, embedding_init=init)(tokens)
        x = stack.LinenLayers(LinenBlock, LAYERS, name="blocks")(x)
        return _dense(VOCAB, ("embed", "vocab"))(nn.RMSNorm()(x))


def linen_loss(model, batch):
    return next_token_loss(model(batch["tokens"][:, :-1]), batch["tokens"])


# -- Equinox ---------------------------------------------------------------------------------


def _each_token(layer, x):
    return jax.vmap(jax.vmap(layer))(x)


class EqxBlock(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 7)
        self.attention_norm = eqx.nn.RMSNorm(WIDTH)
        self.q = eqx.nn.Linear(WIDTH, HEADS * HEAD, use_bias=False, key=keys[0])
        self.k = eqx.nn.Linear(WIDTH, KV_HEADS * HEAD, use_bias=False, key=keys[1])
        self.v = eqx.nn.Linear(WIDTH, KV_HEADS * HEAD, use_bias=False, key=keys[2])
        self.o = eqx.nn.Linear(HEADS * HEAD, WIDTH, use_bias=False, key=keys[3])
        self.mlp_norm = eqx.nn.RMSNorm(WIDTH)
        self.gate = eqx.nn.Linear(WIDTH, MLP, use_bias=False, key=keys[4])
        self.up = eqx.nn.Linear(WIDTH, MLP, use_bias=False, key=keys[5])
        self.down = eqx.nn.Linear(MLP, WIDTH, use_bias=False, key=keys[6])

    def __call__(self, x):
        h = _each_token(self.attention_norm, x)
        q, k, v = (_each_token(p, h) for p in (self.q, self.k, self.v))
        x = x + _each_token(self.o, attend(q, k, v, HEADS, KV_HEADS))
        h = _each_token(self.mlp_norm, x)
        hidden = jax.nn.silu(_each_token(self.gate, h)) * _each_token(self.up, h)
        return x + _each_token(self.down, hidden)


class EqxLlama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: EqxBlock
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.blocks = stack.equinox_layers(EqxBlock, LAYERS, keys[1])
        self.norm = eqx.nn.RMSNorm(WIDTH)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=keys[2])

    def __call__(self, tokens):
        x = stack.apply(self.blocks, _each_token(self.embed, tokens))
        return _each_token(self.head, _each_token(self.norm, x))


#: Equinox's arrays carry no names: these give them (Linear's weight is (out, in))
EQX_RULES = {
    r"embed/weight": ("vocab", "embed"),
    r"blocks/(q|k|v)/weight": ("layers", "heads", "embed"),
    r"blocks/o/weight": ("layers", "embed", "heads"),
    r"blocks/(gate|up)/weight": ("layers", "mlp", "embed"),
    r"blocks/down/weight": ("layers", "embed", "mlp"),
    r"head/weight": ("vocab", "embed"),
}


def eqx_loss(model, batch):
    return next_token_loss(model(batch["tokens"][:, :-1]), batch["tokens"])


# -- the three, and their yardsticks ---------------------------------------------------------


def adapter(framework: str, kv_heads: int = KV_HEADS):
    if framework == "nnx":
        return shardplug.from_nnx(lambda rngs: NnxLlama(rngs, kv_heads)), nnx_loss
    if framework == "linen":
        sample = jnp.zeros((1, SEQUENCE - 1), jnp.int32)
        return shardplug.from_linen(LinenLlama(), sample), linen_loss
    return shardplug.from_equinox(EqxLlama, rules=EQX_RULES), eqx_loss


def one_device_losses(framework: str, steps: int, seed: int = 0, kv_heads: int = KV_HEADS):
    """The plain loop each framework's docs write, on one device, from the trainer's key."""
    key, data = jax.random.key(seed), batches(seed)
    tx = optax.adam(LR)
    with jax.default_device(jax.devices()[0]):
        if framework == "nnx":
            with nnx.use_eager_sharding(False):
                model = NnxLlama(nnx.Rngs(key), kv_heads)
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

            @nnx.jit
            def nnx_step(model, optimizer, batch):
                loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
                optimizer.update(model, grads)
                return loss

            return [float(nnx_step(model, optimizer, next(data))) for _ in range(steps)]
        if framework == "linen":
            module = LinenLlama()
            params = nn.unbox(module.init(key, jnp.zeros((1, SEQUENCE - 1), jnp.int32)))["params"]
            opt_state = tx.init(params)

            @jax.jit
            def linen_step(params, opt_state, batch):
                def loss_of(params):
                    return linen_loss(module.bind({"params": params}), batch)

                loss, grads = jax.value_and_grad(loss_of)(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            losses = []
            for _ in range(steps):
                params, opt_state, loss = linen_step(params, opt_state, next(data))
                losses.append(float(loss))
            return losses
        model = EqxLlama(key)
        opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def eqx_step(model, opt_state, batch):
            loss, grads = eqx.filter_value_and_grad(eqx_loss)(model, batch)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = tx.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, loss

        losses = []
        for _ in range(steps):
            model, opt_state, loss = eqx_step(model, opt_state, next(data))
            losses.append(float(loss))
        return losses
