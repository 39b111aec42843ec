"""The reference models in Equinox, with their sharding rules by parameter path.

Equinox parameters carry no annotations; each model comes with regular-expression rules
that give them logical axis names. Every module takes a batch, ``key`` and ``inference``
(and the CNN its ``eqx.nn.State``).
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from shardplug import stack
from shardplug.models import synthetic
from shardplug.models.layers import batch_moments, dropout
from shardplug.models.nnx_models import (
    CHANNELS,
    DROPOUT,
    EMBED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    Rule,
    attention,
    balanced,
    mixture,
    packed_rows,
    placed,
)


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, n_in: int, hidden: int, n_out: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1 = eqx.nn.Linear(n_in, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, hidden, key=k2)
        self.out = eqx.nn.Linear(hidden, n_out, key=k3)

    def __call__(self, x, *, key=None, inference=False):
        x = jax.nn.relu(jax.vmap(self.fc1)(x))
        x = jax.nn.relu(jax.vmap(self.fc2)(x))
        return jax.vmap(self.out)(x)


# Equinox's Linear keeps weight as (out, in).
MLP_RULES = {
    r"fc1/weight": ("mlp", "embed"),
    r"fc2/weight": ("embed", "mlp"),
    r"out/weight": (None, "embed"),
    r"fc1/bias": ("mlp",),
}


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    shape = (1,) * (x.ndim - 1) + (-1,)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale.reshape(shape) + bias.reshape(shape)


class Block(eqx.Module):
    norm1: tuple[jax.Array, jax.Array]
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    norm2: tuple[jax.Array, jax.Array]
    wi: jax.Array | None = None
    wf: jax.Array | None = None
    router: jax.Array | None = None
    experts_in: jax.Array | None = None
    experts_out: jax.Array | None = None
    rule: Rule = eqx.field(static=True, default=Rule())

    def __init__(self, key: jax.Array, experts: int = 0, rule: Rule | None = None):
        keys = jax.random.split(key, 7)
        normal = jax.nn.initializers.normal(0.02)
        self.norm1 = (jnp.ones(EMBED), jnp.zeros(EMBED))
        self.norm2 = (jnp.ones(EMBED), jnp.zeros(EMBED))
        self.wq = normal(keys[0], (EMBED, HEADS, HEAD_DIM))
        self.wk = normal(keys[1], (EMBED, HEADS, HEAD_DIM))
        self.wv = normal(keys[2], (EMBED, HEADS, HEAD_DIM))
        self.wo = normal(keys[3], (HEADS, HEAD_DIM, EMBED))
        self.rule = rule or Rule()
        if experts:
            self.router = normal(keys[6], (EMBED, experts))
            self.experts_in = normal(keys[4], (experts, EMBED, HIDDEN))
            self.experts_out = normal(keys[5], (experts, HIDDEN, EMBED))
        else:
            self.wi = normal(keys[4], (EMBED, HIDDEN))
            self.wf = normal(keys[5], (HIDDEN, EMBED))

    def __call__(self, x, bias=None, segment_ids=None):
        x = x + attention(_layer_norm(x, *self.norm1), self.wq, self.wk, self.wv, self.wo,
                          segment_ids)  # fmt: skip
        if self.router is None:
            return x + jax.nn.gelu(_layer_norm(x, *self.norm2) @ self.wi) @ self.wf
        out, aux = mixture(_layer_norm(x, *self.norm2), self.router, self.experts_in,
                           self.experts_out, self.rule, bias)  # fmt: skip
        return x + out, aux


class TransformerLM(eqx.Module):
    embed: jax.Array
    position: jax.Array
    blocks: Block  # stacked: every array has a leading layer dimension
    norm: tuple[jax.Array, jax.Array]
    unembed: jax.Array
    remat: str = eqx.field(static=True, default="none")
    rule: Rule = eqx.field(static=True, default=None)
    router_bias: eqx.nn.StateIndex | None = None  # (layers, experts): state, not trained

    def __init__(
        self,
        key: jax.Array,
        layers: int = LAYERS,
        remat: str = "none",
        sequence: int = synthetic.SEQ_LEN,
        experts: int = 0,
        **rule: object,
    ):
        keys = jax.random.split(key, 4)
        normal = jax.nn.initializers.normal(0.02)
        self.embed = normal(keys[0], (synthetic.VOCAB, EMBED))
        self.position = normal(keys[1], (sequence, EMBED))
        self.rule = Rule(**rule)
        block = functools.partial(Block, experts=experts, rule=self.rule)
        self.blocks = stack.equinox_layers(block, layers, keys[2])
        self.norm = (jnp.ones(EMBED), jnp.zeros(EMBED))
        self.unembed = normal(keys[3], (EMBED, synthetic.VOCAB))
        self.remat = remat
        if experts and self.rule.bias_rate is not None:  # built by eqx.nn.make_with_state
            self.router_bias = eqx.nn.StateIndex(jnp.zeros((layers, experts), jnp.float32))

    def __call__(self, tokens, state=None, *, key=None, inference=False, segment_ids=None,
                 positions=None):  # fmt: skip
        """The logits; with experts ``(logits, tallies)``; with a routing bias
        ``((logits, tallies, bias), new_state)``, as a stateful Equinox model returns."""
        x = self.embed[tokens] + placed(self.position, tokens, positions)
        bias = None if self.router_bias is None else state.get(self.router_bias)
        x = stack.apply(self.blocks, x, remat=self.remat, per_layer=bias,
                        rows=packed_rows(segment_ids))  # fmt: skip
        if not isinstance(x, tuple):
            return _layer_norm(x, *self.norm) @ self.unembed
        logits = _layer_norm(x[0], *self.norm) @ self.unembed
        if bias is None:
            return logits, x[1]
        if not inference:
            state = state.set(self.router_bias, balanced(bias, x[1], self.rule))
        return (logits, x[1], bias), state


TRANSFORMER_RULES = {
    r"embed": ("vocab", "embed"),
    r"position": (None, "embed"),
    r"unembed": ("embed", "vocab"),
    r"blocks/w[qkv]": ("layers", "embed", "heads", "kv"),
    r"blocks/wo": ("layers", "heads", "kv", "embed"),
    r"blocks/wi": ("layers", "embed", "mlp"),
    r"blocks/wf": ("layers", "mlp", "embed"),
    r"blocks/norm[12]/[01]": ("layers", "embed"),
    r"norm/[01]": ("embed",),
}
MOE_RULES = {
    r"blocks/router": ("layers", "embed", None),
    r"blocks/experts_in": ("layers", "expert", "embed", "mlp"),
    r"blocks/experts_out": ("layers", "expert", "mlp", "embed"),
}


def transformer_rules(experts: int | None = None, **_: object) -> dict:
    """The transformer's rules: its MLP's, or its experts' and router's."""
    if not experts:
        return TRANSFORMER_RULES
    dense = {k: v for k, v in TRANSFORMER_RULES.items() if k not in ("blocks/wi", "blocks/wf")}
    return {**dense, **MOE_RULES}


class BatchNorm(eqx.Module):
    """Batch normalisation over (batch, height, width); running statistics in eqx.nn.State."""

    scale: jax.Array
    bias: jax.Array
    stats: eqx.nn.StateIndex
    momentum: float = eqx.field(static=True, default=0.99)

    def __init__(self, channels: int):
        self.scale = jnp.ones(channels)
        self.bias = jnp.zeros(channels)
        self.stats = eqx.nn.StateIndex((jnp.zeros(channels), jnp.ones(channels)))

    def __call__(self, x, state, inference):
        running_mean, running_var = state.get(self.stats)
        if inference:
            mean, var = running_mean, running_var
        else:
            mean, var = batch_moments(x, axes=(0, 1, 2))
            m = self.momentum
            state = state.set(
                self.stats, (m * running_mean + (1 - m) * mean, m * running_var + (1 - m) * var)
            )
        shape = (1,) * (x.ndim - 1) + (-1,)  # per channel, the last axis
        mean, var = mean.reshape(shape), var.reshape(shape)
        scale, bias = self.scale.reshape(shape), self.bias.reshape(shape)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias, state


class CNN(eqx.Module):
    """conv-BN-ReLU x2, pooling, dropout, linear; takes NHWC images like the other two."""

    conv1: eqx.nn.Conv2d
    norm1: BatchNorm
    conv2: eqx.nn.Conv2d
    norm2: BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, CHANNELS, 3, padding=1, use_bias=False, key=k1)
        self.norm1 = BatchNorm(CHANNELS)
        self.conv2 = eqx.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = BatchNorm(CHANNELS)
        pooled = (synthetic.IMAGE // 2) ** 2 * CHANNELS
        self.head = eqx.nn.Linear(pooled, synthetic.IMAGE_CLASSES, key=k3)

    def __call__(self, images, state, *, key=None, inference=False):
        def conv(layer, x):  # Equinox convolutions take one CHW example
            return jnp.moveaxis(jax.vmap(layer)(jnp.moveaxis(x, -1, 1)), 1, -1)

        x, state = self.norm1(conv(self.conv1, images), state, inference)
        x, state = self.norm2(conv(self.conv2, jax.nn.relu(x)), state, inference)
        x = jax.nn.relu(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4)).reshape(b, -1)
        if not inference:
            x = dropout(x, DROPOUT, key)
        return jax.vmap(self.head)(x), state


CNN_RULES = {r"conv[12]/weight": ("mlp",), r"head/weight": (None, "embed")}


def regressor(key):
    return MLP(synthetic.REGRESSION_INPUTS, 128, 1, key)


def classifier(key):
    return MLP(synthetic.CLASSIFICATION_INPUTS, 128, synthetic.CLASSES, key)


def transformer(layers: int = LAYERS, remat: str = "none", sequence: int = synthetic.SEQ_LEN,
                **moe_options):  # fmt: skip
    """A function ``key -> TransformerLM`` of this depth and remat policy (and ``experts``,
    :class:`~shardplug.models.nnx_models.Rule`'s ``top_k``, ``capacity_factor``,
    ``capacity_groups``)."""
    if moe_options.get("experts") and moe_options.get("bias_rate") is not None:
        build = eqx.nn.make_with_state(TransformerLM)  # the routing bias is state
        return lambda key: build(key, layers, remat, sequence, **moe_options)
    return lambda key: TransformerLM(key, layers, remat, sequence, **moe_options)


def cnn(key):
    return eqx.nn.make_with_state(CNN)(key)
