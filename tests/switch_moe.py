"""A Switch Transformer layer written the way GShard and Switch write it, in Flax NNX: top-1
routing, a capacity per expert in each sequence, and the tokens dispatched to their experts
and combined back by dense einsums over one-hot masks. Its expert weights carry a leading
expert dimension named ``expert_name`` (``"expert"``, as ep looks for it, by default). Nothing
in it calls shardplug."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, WIDTH, HIDDEN, EXPERTS, SEQUENCE, ROWS, CAPACITY = 64, 16, 32, 4, 16, 8, 8


class SwitchLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, expert_name: str = "expert"):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.router = nnx.Linear(WIDTH, EXPERTS, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(nnx.with_partitioning(init, (expert_name, None, None))(
            rngs.params(), (EXPERTS, WIDTH, HIDDEN)))  # fmt: skip
        self.w_out = nnx.Param(nnx.with_partitioning(init, (expert_name, None, None))(
            rngs.params(), (EXPERTS, HIDDEN, WIDTH)))  # fmt: skip
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def experts(self, x):
        """GShard's dispatch and combine: each sequence a group, CAPACITY slots an expert."""
        probs = jax.nn.softmax(self.router(x), axis=-1)  # (b, s, e)
        expert = jnp.argmax(probs, axis=-1)
        chosen = jax.nn.one_hot(expert, EXPERTS)  # (b, s, e)
        place = (jnp.cumsum(chosen, axis=1) * chosen - 1).astype(jnp.int32)  # in its queue
        dispatch = chosen[..., None] * jax.nn.one_hot(place, CAPACITY)  # (b, s, e, c)
        combine = dispatch * jnp.max(probs, axis=-1)[..., None, None]
        inputs = jnp.einsum("bsec,bsd->becd", dispatch, x)
        hidden = jax.nn.relu(jnp.einsum("becd,edh->bech", inputs, self.w_in[...]))
        outputs = jnp.einsum("bech,ehd->becd", hidden, self.w_out[...])
        return jnp.einsum("bsec,becd->bsd", combine, outputs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.experts(x))


def loss_fn(model, batch):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        yield {"tokens": rng.integers(0, VOCAB, (ROWS, SEQUENCE + 1), dtype=np.int32)}
