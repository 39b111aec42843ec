"""The reference models in Flax Linen, annotated with ``nn.with_logical_partitioning``.

Every module takes ``train`` so that one calling convention serves them all.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardplug import stack
from shardplug.core.context import batch_axis_name
from shardplug.models import synthetic
from shardplug.models.layers import dropout
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

_lecun = nn.initializers.lecun_normal()


def _dense(features: int, names: tuple) -> nn.Dense:
    return nn.Dense(
        features,
        kernel_init=nn.with_logical_partitioning(_lecun, names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[1:]),
    )


class MLP(nn.Module):
    hidden: int
    n_out: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.relu(_dense(self.hidden, ("embed", "mlp"))(x))
        x = nn.relu(_dense(self.hidden, ("mlp", "embed"))(x))
        return _dense(self.n_out, ("embed", None))(x)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), names)
    return module.param(name, init, shape)


def _norm() -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-6,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
    )


class Block(nn.Module):
    experts: int = 0
    rule: Rule = Rule()

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None = None, segment_ids=None):
        qkv = (EMBED, HEADS, HEAD_DIM)
        w = {n: _param(self, n, qkv, ("embed", "heads", "kv")) for n in ("wq", "wk", "wv")}
        wo = _param(self, "wo", (HEADS, HEAD_DIM, EMBED), ("heads", "kv", "embed"))
        x = x + attention(_norm()(x), w["wq"], w["wk"], w["wv"], wo, segment_ids)
        if not self.experts:
            wi = _param(self, "wi", (EMBED, HIDDEN), ("embed", "mlp"))
            wf = _param(self, "wf", (HIDDEN, EMBED), ("mlp", "embed"))
            return x + nn.gelu(_norm()(x) @ wi) @ wf
        e = self.experts
        router = _param(self, "router", (EMBED, e), ("embed", None))
        experts_in = _param(self, "experts_in", (e, EMBED, HIDDEN), ("expert", "embed", "mlp"))
        experts_out = _param(self, "experts_out", (e, HIDDEN, EMBED), ("expert", "mlp", "embed"))
        out, aux = mixture(_norm()(x), router, experts_in, experts_out, self.rule, bias)
        return x + out, aux


class TransformerLM(nn.Module):
    layers: int = LAYERS
    remat: str = "none"
    sequence: int = synthetic.SEQ_LEN
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    capacity_groups: int = 1
    bias_rate: float | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False,
                 segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):  # fmt: skip
        embed = _param(self, "embed", (synthetic.VOCAB, EMBED), ("vocab", "embed"))
        position = _param(self, "position", (self.sequence, EMBED), (None, "embed"))
        x = embed[tokens] + placed(position, tokens, positions)
        rule = Rule(self.top_k, self.capacity_factor, self.capacity_groups, self.bias_rate)
        block = functools.partial(Block, experts=self.experts, rule=rule)
        bias = None
        if self.experts and self.bias_rate is not None:  # model state: the "moe" collection
            shape = (self.layers, self.experts)
            bias = self.variable("moe", "router_bias", jnp.zeros, shape, jnp.float32)
        per_layer = None if bias is None else bias.value
        x = stack.LinenLayers(block, self.layers, self.remat, name="blocks")(
            x, per_layer, rows=packed_rows(segment_ids)
        )
        x, aux = x if isinstance(x, tuple) else (x, None)
        unembed = _param(self, "unembed", (EMBED, synthetic.VOCAB), ("embed", "vocab"))
        logits = _norm()(x) @ unembed
        if aux is None:
            return logits
        if bias is None:
            return logits, aux
        if train and not self.is_initializing():
            bias.value = balanced(per_layer, aux, rule)
        return logits, aux, per_layer


class CNN(nn.Module):
    """conv-BN-ReLU x2, pooling, dropout, linear; batch statistics in ``batch_stats``."""

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> jax.Array:
        conv = nn.with_logical_partitioning(_lecun, (None, None, None, "mlp"))
        x = images
        for _ in range(2):
            x = nn.Conv(CHANNELS, (3, 3), use_bias=False, kernel_init=conv)(x)  # BN follows
            # axis_name: the global batch's statistics inside a per-device program too
            x = nn.BatchNorm(use_running_average=not train, axis_name=batch_axis_name())(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2)).reshape(images.shape[0], -1)
        if train:
            x = dropout(x, DROPOUT, self.make_rng("dropout"))
        return _dense(synthetic.IMAGE_CLASSES, ("embed", None))(x)


def sample_input(model: str, sequence: int | None = None) -> jnp.ndarray:
    """A one-row input of the right shape, for ``module.init``."""
    shapes = {
        "mlp": ((1, synthetic.REGRESSION_INPUTS), jnp.float32),
        "classifier": ((1, synthetic.CLASSIFICATION_INPUTS), jnp.float32),
        "transformer": ((1, sequence or synthetic.SEQ_LEN), jnp.int32),
        "cnn": ((1, synthetic.IMAGE, synthetic.IMAGE, 1), jnp.float32),
    }
    shape, dtype = shapes[model]
    return jnp.zeros(shape, dtype)


MODULES = {
    "mlp": MLP(128, 1),
    "classifier": MLP(128, synthetic.CLASSES),
    "transformer": TransformerLM(),
    "cnn": CNN(),
}
