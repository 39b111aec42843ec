"""The transformer reference model: a small decoder-only language model.

Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``, ``kv``, ``mlp``),
so ``2d`` splits heads, MLP units and vocabulary over ``model`` and ``fsdp`` splits ``embed``.
Its data are sequences from a sparse Markov chain: next-token loss can fall from ln(vocab)
towards the chain's entropy, about 0.9 nats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq_len: int = 32
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple, std: float = 0.02) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Param(init(rngs.params(), shape))


def _norm(cfg: Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        cfg.embed,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        e, h, d = cfg.embed, cfg.heads, cfg.head_dim
        self.norm1 = _norm(cfg, rngs)
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (e, h, d), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (e, h, d), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (h, d, e), ("heads", "kv", "embed"))
        self.norm2 = _norm(cfg, rngs)
        self.wi = _param(rngs, (e, cfg.mlp), ("embed", "mlp"))
        self.wf = _param(rngs, (cfg.mlp, e), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.norm1(x)
        q = jnp.einsum("bse,ehd->bshd", y, self.wq[...])
        k = jnp.einsum("bse,ehd->bshd", y, self.wk[...])
        v = jnp.einsum("bse,ehd->bshd", y, self.wv[...])
        scores = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        causal = jnp.tril(jnp.ones((1, 1, x.shape[1], x.shape[1]), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attended = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("bshd,hde->bse", attended, self.wo[...])
        y = self.norm2(x)
        return x + nnx.gelu(y @ self.wi[...]) @ self.wf[...]


class TransformerLM(nnx.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an unembedding."""

    def __init__(self, cfg: Config = Config(), *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.position = _param(rngs, (cfg.seq_len, cfg.embed), (None, "embed"))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = _norm(cfg, rngs)
        self.unembed = _param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[...][tokens] + self.position[...][None, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.unembed[...]


def transformer(rngs: nnx.Rngs) -> TransformerLM:
    return TransformerLM(Config(), rngs=rngs)


def markov_batches(batch_size: int, seed: int = 0, cfg: Config = Config()) -> Iterator[Batch]:
    """Endless ``{"tokens", "targets"}`` batches from a sparse Markov chain.

    Each token is followed by one of three tokens with probabilities 0.6, 0.3 and 0.1; the
    chain is the same for every seed, the sampled sequences differ.
    """
    table = np.random.default_rng(4321)
    successors = np.stack([table.permutation(cfg.vocab)[:3] for _ in range(cfg.vocab)])
    cumulative = np.array([0.6, 0.9, 1.0])
    step = 0
    while True:
        rng = np.random.default_rng((seed, step))
        seq = np.empty((batch_size, cfg.seq_len + 1), dtype=np.int32)
        seq[:, 0] = rng.integers(0, cfg.vocab, batch_size)
        choice = np.searchsorted(cumulative, rng.random((batch_size, cfg.seq_len)), side="right")
        for t in range(cfg.seq_len):
            seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
        yield {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
        step += 1


def lm_loss(model, batch: Batch) -> jax.Array:
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
