"""The decoder every supported family is: one forward pass over a dict of arrays, and the
module that holds those arrays in each framework (Flax NNX, Flax Linen, Equinox).

The parameters, by the names the three modules give them (each with its logical axes, which
the strategies read): ``embed`` (vocab, width); ``layers/...`` stacked over a leading layer
dimension (a :mod:`shardplug.stack` layer stack, so ``pp`` splits it): ``attention_norm``,
``q``, ``k``, ``v``, ``o`` (input dimension first), Qwen2's ``q_bias``/``k_bias``/``v_bias``,
Qwen3's ``q_norm``/``k_norm``, ``mlp_norm``, and ``gate``, ``up``, ``down`` (Mixtral's with an
expert dimension after the layer's, and its ``router``); ``norm``; ``head`` (width, vocab)
unless the output is tied to the embedding. Attention is :func:`shardplug.attention` (so
``cp`` supplies its ring, grouped-query heads and all), Mixtral's experts
:func:`shardplug.moe.routed_experts` (so ``ep`` places them).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from shardplug import moe, stack
from shardplug.core.attention import attention
from shardplug.errors import PretrainedError
from shardplug.pretrained.config import DecoderConfig

Table = dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]


def table(c: DecoderConfig) -> tuple[Table, Table]:
    """``(outer, layers)``: each parameter's shape and logical axes; a layer's parameters
    are listed without their leading layer dimension (``layers``)."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    outer: Table = {"embed": ((c.vocab, c.width), ("vocab", "embed")),
                    "norm": ((c.width,), (None,))}  # fmt: skip
    if not c.tied:
        outer["head"] = ((c.width, c.vocab), ("embed", "vocab"))
    layer: Table = {
        "attention_norm": ((c.width,), (None,)),
        "q": ((c.width, q), ("embed", "heads")),
        "k": ((c.width, kv), ("embed", "heads")),
        "v": ((c.width, kv), ("embed", "heads")),
        "o": ((q, c.width), ("heads", "embed")),
        "mlp_norm": ((c.width,), (None,)),
    }
    if c.qkv_bias:
        layer.update(q_bias=((q,), ("heads",)), k_bias=((kv,), ("heads",)),
                     v_bias=((kv,), ("heads",)))  # fmt: skip
    if c.qk_norm:
        layer.update(q_norm=((c.head_dim,), (None,)), k_norm=((c.head_dim,), (None,)))
    if c.experts:
        e = c.experts
        layer.update(
            router=((c.width, e), ("embed", None)),
            gate=((e, c.width, c.mlp), ("expert", "embed", "mlp")),
            up=((e, c.width, c.mlp), ("expert", "embed", "mlp")),
            down=((e, c.mlp, c.width), ("expert", "mlp", "embed")),
        )
    else:
        layer.update(gate=((c.width, c.mlp), ("embed", "mlp")),
                     up=((c.width, c.mlp), ("embed", "mlp")),
                     down=((c.mlp, c.width), ("mlp", "embed")))  # fmt: skip
    return outer, layer


def _init(key: jax.Array, name: str, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A fresh model's values (for training from scratch or for planning): norms at 1."""
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return 0.02 * jax.random.normal(key, shape, dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm: normalised in float32, cast back, then scaled."""
    f = x.astype(jnp.float32)
    f = f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)
    return _lastdim(weight, x.ndim) * f.astype(x.dtype)


def _lastdim(v: jax.Array, ndim: int) -> jax.Array:
    """A vector shaped to broadcast over the last dimension of an ``ndim`` array."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary positions on ``(batch, sequence, heads, head_dim)``: the two halves of each
    head rotate as pairs (the Hugging Face layout: ``rotate_half``)."""
    cos, sin = (t[None, :, None, :].astype(x.dtype) for t in (cos, sin))
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def forward(c: DecoderConfig, p: dict[str, Any], tokens: jax.Array, remat: str = "none"):
    """Logits (batch, sequence, vocab) of ``tokens`` (batch, sequence); with experts
    ``(logits, tallies)``, the tallies each layer's :class:`shardplug.moe.Tally`."""
    length = tokens.shape[1]
    if c.sliding_window is not None and length > c.sliding_window:
        raise PretrainedError(
            f"sequence {length} is longer than the model's sliding window {c.sliding_window}: "
            f"windowed attention is not built; train on sequences of at most {c.sliding_window}"
        )
    inv = jnp.asarray(c.inverse_frequencies(), jnp.float32)
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)

    def block(lp: dict[str, jax.Array], x: jax.Array):
        batch = x.shape[0]  # under pp, a microbatch's
        h = rms_norm(x, lp["attention_norm"], c.norm_eps)
        q, k, v = (h @ lp[n] for n in "qkv")
        if c.qkv_bias:
            biases = (_lastdim(lp[f"{n}_bias"], 3) for n in "qkv")
            q, k, v = (p + b for p, b in zip((q, k, v), biases, strict=True))
        q = q.reshape(batch, length, c.heads, c.head_dim)
        k = k.reshape(batch, length, c.kv_heads, c.head_dim)
        v = v.reshape(batch, length, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms_norm(q, lp["q_norm"], c.norm_eps), rms_norm(k, lp["k_norm"], c.norm_eps)
        out = attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, causal=True)
        x = x + out.reshape(batch, length, c.heads * c.head_dim) @ lp["o"]
        h = rms_norm(x, lp["mlp_norm"], c.norm_eps)
        if not c.experts:
            return x + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
        flat = h.reshape(batch * length, c.width)
        logits = flat @ lp["router"]
        routing = moe.route(logits, c.top_k)
        y, stats = moe.routed_experts(flat, routing, lp["up"], lp["down"], w_gate=lp["gate"])
        y = y.reshape(batch, length, c.width).astype(x.dtype)
        return x + y, moe.tally(logits, routing, stats)

    x = jnp.take(p["embed"], tokens, axis=0)
    out = stack.scan(block, p["layers"], x, remat=remat)
    x, tallies = out if c.experts else (out, None)
    x = rms_norm(x, p["norm"], c.norm_eps)
    logits = x @ (p["embed"].T if c.tied else p["head"])
    return logits if tallies is None else (logits, tallies)


# -- the three frameworks' modules -----------------------------------------------------------


class NnxParams(nnx.Module):
    """A group of NNX parameters built from a table (``layers`` stacked ``count`` deep)."""

    def __init__(self, entries: Table, dtype: Any, rngs: nnx.Rngs, count: int = 0):
        for name, (shape, names) in entries.items():
            if count:
                shape, names = (count, *shape), (stack.LAYERS, *names)
            value = _init(rngs.params(), name, shape, dtype)
            setattr(self, name, nnx.Param(value, out_sharding=names))

    def arrays(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class NnxDecoder(nnx.Module):
    """The decoder in Flax NNX: ``model(tokens)`` gives logits (and Mixtral's tallies)."""

    def __init__(self, config: DecoderConfig, *, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs, remat: str = "none"):  # fmt: skip
        outer, layer = table(config)
        self.config, self.remat = config, remat
        self.outer = NnxParams(outer, dtype, rngs)
        self.layers = NnxParams(layer, dtype, rngs, count=config.layers)

    def __call__(self, tokens: jax.Array):
        arrays = {**self.outer.arrays(), "layers": self.layers.arrays()}
        return forward(self.config, arrays, tokens, self.remat)


class LinenDecoder(nn.Module):
    """The decoder in Flax Linen: ``model.apply(variables, tokens)``."""

    config: DecoderConfig
    dtype: Any = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens: jax.Array):
        outer, layer = table(self.config)

        def made(name, shape, names):
            init = nn.with_logical_partitioning(
                lambda key, shape, dtype: _init(key, name, shape, dtype), names
            )
            return self.param(name, init, shape, self.dtype)

        arrays: dict[str, Any] = {n: made(n, s, a) for n, (s, a) in outer.items()}
        count = self.config.layers
        arrays["layers"] = {
            n: made(f"layers_{n}", (count, *s), (stack.LAYERS, *a)) for n, (s, a) in layer.items()
        }
        return forward(self.config, arrays, tokens, self.remat)


class EqxDecoder(eqx.Module):
    """The decoder in Equinox: ``model(tokens)``; its logical axes are in :func:`eqx_rules`."""

    arrays: dict[str, Any]
    config: DecoderConfig = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: jax.Array, *, dtype: Any = jnp.float32,
                 remat: str = "none"):  # fmt: skip
        outer, layer = table(config)
        keys = iter(jax.random.split(key, len(outer) + len(layer)))
        arrays: dict[str, Any] = {n: _init(next(keys), n, s, dtype) for n, (s, _) in outer.items()}
        arrays["layers"] = {n: _init(next(keys), n, (config.layers, *s), dtype)
                            for n, (s, _) in layer.items()}  # fmt: skip
        self.arrays, self.config, self.remat = arrays, config, remat

    def __call__(self, tokens: jax.Array):
        return forward(self.config, self.arrays, tokens, self.remat)


def eqx_rules(c: DecoderConfig) -> dict[str, tuple[str | None, ...]]:
    """The Equinox decoder's logical axes, as rules over its parameter paths."""
    outer, layer = table(c)
    rules = {f"arrays/{n}": a for n, (_, a) in outer.items()}
    rules.update({f"arrays/layers/{n}": (stack.LAYERS, *a) for n, (_, a) in layer.items()})
    return rules
