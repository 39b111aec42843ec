"""The decoder every supported family is: one forward pass over a dict of arrays, and the
module that holds those arrays in each framework (Flax NNX, Flax Linen, Equinox).

The parameters, by the names the three modules give them (each with its logical axes, which
the strategies read): ``embed`` (vocab, width); ``layers/...`` stacked over a leading layer
dimension (a :mod:`shardplug.stack` layer stack, so ``pp`` splits it): ``attention_norm``,
``q``, ``k``, ``v``, ``o`` (input dimension first), Qwen2's ``q_bias``/``k_bias``/``v_bias``,
Qwen3's and Gemma's ``q_norm``/``k_norm``, ``mlp_norm``, ``post_attention_norm`` and
``post_mlp_norm`` (where the family's traits have ``post_norms``: Gemma), and ``gate``, ``up``,
``down`` (Mixtral's with an expert dimension after the layer's, and its ``router``); ``norm``;
``head`` (width, vocab) unless the output is tied to the embedding. What a family does that
its config does not state is in its :class:`~shardplug.pretrained.config.Traits`. Attention
is :func:`shardplug.attention` (so ``cp`` supplies its ring, grouped-query heads and all),
Mixtral's experts :func:`shardplug.moe.routed_experts` (so ``ep`` places them).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from shardplug import moe, stack
from shardplug.core.operations.attention import attention
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
    if c.traits.post_norms:
        layer.update(post_attention_norm=((c.width,), (None,)),
                     post_mlp_norm=((c.width,), (None,)))  # fmt: skip
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


def _init(key: jax.Array, name: str, shape: tuple[int, ...], dtype: Any,
          plus_one: bool = False) -> jax.Array:  # fmt: skip
    """A fresh model's values (for training from scratch or for planning): norms scaling by
    1 (their weights at 0 where norms scale by 1 + weight)."""
    if name.endswith("norm"):
        return (jnp.zeros if plus_one else jnp.ones)(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return 0.02 * jax.random.normal(key, shape, dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """Llama's RMSNorm: normalised in float32, cast back, then scaled; with ``plus_one``
    (Gemma's): scaled by ``1 + weight`` in float32, then cast back."""
    f = x.astype(jnp.float32)
    f = f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (f * (1.0 + _lastdim(weight, x.ndim).astype(jnp.float32))).astype(x.dtype)
    return _lastdim(weight, x.ndim) * f.astype(x.dtype)


def _lastdim(v: jax.Array, ndim: int) -> jax.Array:
    """A vector shaped to broadcast over the last dimension of an ``ndim`` array."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary positions on ``(batch, sequence, heads, head_dim)``: the two halves of each
    head rotate as pairs (the Hugging Face layout: ``rotate_half``); with fewer frequencies
    than half a head (a partial rotary), the two halves of its leading dimensions, the rest
    left as they are."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        return jnp.concatenate([_rotate(x[..., :turned], cos, sin), x[..., turned:]], -1)
    # (sequence, frequencies), or a row's own positions': (rows, sequence, frequencies)
    cos, sin = ((t[None] if t.ndim == 2 else t)[:, :, None, :].astype(x.dtype)
                for t in (cos, sin))  # fmt: skip
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def _angles(c: DecoderConfig, positions: jax.Array, local: bool) -> tuple[jax.Array, jax.Array]:
    inv = jnp.asarray(c.inverse_frequencies(local), jnp.float32)
    angle = positions.astype(jnp.float32)[..., None] * inv.reshape((1,) * positions.ndim + (-1,))
    return jnp.cos(angle), jnp.sin(angle)


def forward(c: DecoderConfig, p: dict[str, Any], tokens: jax.Array, remat: str = "none",
            segment_ids: jax.Array | None = None, positions: jax.Array | None = None):  # fmt: skip
    """Logits (batch, sequence, vocab) of ``tokens`` (batch, sequence); with experts
    ``(logits, tallies)``, the tallies each layer's :class:`shardplug.moe.Tally`.

    A sliding layer sees the keys less than ``sliding_window`` positions back: a mask, given
    only where the sequence is longer than the window (so elsewhere attention keeps its
    fused kernels and ``cp`` its ring; with the mask ``cp`` gathers the keys instead).

    Packed documents: ``segment_ids`` (batch, sequence) keep each token's attention to its
    own document, and ``positions`` (each token's place in its document; (sequence,) or
    (batch, sequence)) restart the rotary positions at each; the layer stack is given both
    as its rows (``shardplug.stack.scan(..., rows=)``), so under ``pp`` each microbatch's
    layers see its own."""
    length = tokens.shape[1]
    act = jax.nn.silu if c.activation == "silu" else partial(jax.nn.gelu, approximate=True)
    rows = {}
    if segment_ids is not None:
        rows["segment_ids"] = segment_ids
    if positions is not None and jnp.ndim(positions) == 2:
        rows["positions"] = positions
    windowed = c.sliding_window is not None and length > c.sliding_window
    mixed = c.local_rope is not None and len(set(c.layer_types)) > 1
    only_local = c.local_rope is not None and "full" not in c.layer_types

    def angles(positions):
        """The rotary cosines and sines, the sliding layers' too where they differ."""
        out = {"": _angles(c, positions, local=only_local)}
        if mixed:
            out["local"] = _angles(c, positions, local=True)
        return out

    place_all = jnp.arange(length) if positions is None else positions
    outside = angles(place_all)
    per_layer = {}
    if windowed or mixed:
        per_layer["sliding"] = jnp.asarray([t == "sliding" for t in c.layer_types])

    def norm(x, weight):
        return rms_norm(x, weight, c.norm_eps, c.traits.norm_plus_one)

    def block(lp: dict[str, jax.Array], x: jax.Array, pl: dict[str, jax.Array] | None = None,
              segment_ids: jax.Array | None = None,
              positions: jax.Array | None = None):  # fmt: skip
        batch = x.shape[0]  # under pp, a microbatch's
        turns = outside if positions is None else angles(positions)
        h = norm(x, lp["attention_norm"])
        q, k, v = (h @ lp[n] for n in "qkv")
        if c.qkv_bias:
            biases = (_lastdim(lp[f"{n}_bias"], 3) for n in "qkv")
            q, k, v = (p + b for p, b in zip((q, k, v), biases, strict=True))
        q = q.reshape(batch, length, c.heads, c.head_dim)
        k = k.reshape(batch, length, c.kv_heads, c.head_dim)
        v = v.reshape(batch, length, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = norm(q, lp["q_norm"]), norm(k, lp["k_norm"])
        c_, s_ = turns[""]
        if mixed:
            c_, s_ = (jnp.where(pl["sliding"], a, b) for a, b in zip(turns["local"], turns[""],
                                                                      strict=True))  # fmt: skip
        mask = None
        if windowed:  # by each token's place in its document
            place = place_all if positions is None else positions
            place = place if place.ndim == 2 else place[None]
            reach = jnp.where(pl["sliding"], c.sliding_window, length + 1)
            mask = ((place[:, :, None] - place[:, None, :]) < reach)[:, None]
        out = attention(_rotate(q, c_, s_), _rotate(k, c_, s_), v, causal=True, mask=mask,
                        scale=c.query_scale, segment_ids=segment_ids)  # fmt: skip
        out = out.reshape(batch, length, c.heads * c.head_dim) @ lp["o"]
        x = x + (norm(out, lp["post_attention_norm"]) if c.traits.post_norms else out)
        h = norm(x, lp["mlp_norm"])
        if not c.experts:
            out = (act(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
            return x + (norm(out, lp["post_mlp_norm"]) if c.traits.post_norms else out)
        flat = h.reshape(batch * length, c.width)
        logits = flat @ lp["router"]
        routing = moe.route(logits, c.top_k)
        y, stats = moe.routed_experts(flat, routing, lp["up"], lp["down"], w_gate=lp["gate"])
        y = y.reshape(batch, length, c.width).astype(x.dtype)
        return x + y, moe.tally(logits, routing, stats)

    x = jnp.take(p["embed"], tokens, axis=0)
    if c.traits.embed_scale:  # the scale rounded to the embedding's dtype first, as the reference
        x = x * jnp.asarray(c.width**0.5, jnp.float32).astype(x.dtype)
    out = stack.scan(block, p["layers"], x, remat=remat, per_layer=per_layer or None,
                     rows=rows or None)  # fmt: skip
    x, tallies = out if c.experts else (out, None)
    x = norm(x, p["norm"])
    logits = x @ (p["embed"].T if c.tied else p["head"])
    if c.final_softcap:
        logits = c.final_softcap * jnp.tanh(logits / c.final_softcap)
    return logits if tallies is None else (logits, tallies)


# -- the three frameworks' modules -----------------------------------------------------------


class NnxParams(nnx.Module):
    """A group of NNX parameters built from a table (``layers`` stacked ``count`` deep)."""

    def __init__(self, entries: Table, dtype: Any, rngs: nnx.Rngs, count: int = 0,
                 plus_one: bool = False):  # fmt: skip
        for name, (shape, names) in entries.items():
            if count:
                shape, names = (count, *shape), (stack.LAYERS, *names)
            value = _init(rngs.params(), name, shape, dtype, plus_one)
            setattr(self, name, nnx.Param(value, out_sharding=names))

    def arrays(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class NnxDecoder(nnx.Module):
    """The decoder in Flax NNX: ``model(tokens)`` gives logits (and Mixtral's tallies)."""

    def __init__(self, config: DecoderConfig, *, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs, remat: str = "none"):  # fmt: skip
        outer, layer = table(config)
        self.config, self.remat = config, remat
        plus_one = config.traits.norm_plus_one
        self.outer = NnxParams(outer, dtype, rngs, plus_one=plus_one)
        self.layers = NnxParams(layer, dtype, rngs, count=config.layers, plus_one=plus_one)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):  # fmt: skip
        arrays = {**self.outer.arrays(), "layers": self.layers.arrays()}
        return forward(self.config, arrays, tokens, self.remat, segment_ids, positions)


class LinenDecoder(nn.Module):
    """The decoder in Flax Linen: ``model.apply(variables, tokens)``."""

    config: DecoderConfig
    dtype: Any = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):  # fmt: skip
        outer, layer = table(self.config)

        def made(name, shape, names):
            init = nn.with_logical_partitioning(
                lambda key, shape, dtype: _init(
                    key, name, shape, dtype, self.config.traits.norm_plus_one
                ),
                names,
            )
            return self.param(name, init, shape, self.dtype)

        arrays: dict[str, Any] = {n: made(n, s, a) for n, (s, a) in outer.items()}
        count = self.config.layers
        arrays["layers"] = {
            n: made(f"layers_{n}", (count, *s), (stack.LAYERS, *a)) for n, (s, a) in layer.items()
        }
        return forward(self.config, arrays, tokens, self.remat, segment_ids, positions)


class EqxDecoder(eqx.Module):
    """The decoder in Equinox: ``model(tokens)``; its logical axes are in :func:`eqx_rules`."""

    arrays: dict[str, Any]
    config: DecoderConfig = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: jax.Array, *, dtype: Any = jnp.float32,
                 remat: str = "none"):  # fmt: skip
        outer, layer = table(config)
        keys = iter(jax.random.split(key, len(outer) + len(layer)))
        g = config.traits.norm_plus_one
        arrays: dict[str, Any] = {
            n: _init(next(keys), n, s, dtype, g) for n, (s, _) in outer.items()
        }
        arrays["layers"] = {n: _init(next(keys), n, (config.layers, *s), dtype, g)
                            for n, (s, _) in layer.items()}  # fmt: skip
        self.arrays, self.config, self.remat = arrays, config, remat

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):  # fmt: skip
        return forward(self.config, self.arrays, tokens, self.remat, segment_ids, positions)


def eqx_rules(c: DecoderConfig) -> dict[str, tuple[str | None, ...]]:
    """The Equinox decoder's logical axes, as rules over its parameter paths."""
    outer, layer = table(c)
    rules = {f"arrays/{n}": a for n, (_, a) in outer.items()}
    rules.update({f"arrays/layers/{n}": (stack.LAYERS, *a) for n, (_, a) in layer.items()})
    return rules
