"""The reference models in Flax NNX, with logical-axis annotations on every parameter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardplug import moe, stack
from shardplug.core.context import batch_axis_name
from shardplug.core.operations.attention import attention as fused_attention
from shardplug.models import synthetic
from shardplug.models.layers import dropout

_lecun = nnx.initializers.lecun_normal()


def _dense(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        kernel_init=nnx.with_partitioning(_lecun, names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:]),
        rngs=rngs,
    )


class MLP(nnx.Module):
    """``in -> hidden -> hidden -> out`` with ReLU, Megatron layout (``mlp`` then back)."""

    def __init__(self, n_in: int, hidden: int, n_out: int, *, rngs: nnx.Rngs):
        self.fc1 = _dense(n_in, hidden, ("embed", "mlp"), rngs)
        self.fc2 = _dense(hidden, hidden, ("mlp", "embed"), rngs)
        self.out = _dense(hidden, n_out, ("embed", None), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def regressor(rngs: nnx.Rngs) -> MLP:
    return MLP(synthetic.REGRESSION_INPUTS, 128, 1, rngs=rngs)


def classifier(rngs: nnx.Rngs) -> MLP:
    return MLP(synthetic.CLASSIFICATION_INPUTS, 128, synthetic.CLASSES, rngs=rngs)


# The transformer: pre-norm blocks of causal attention and an MLP.

EMBED, HEADS, HEAD_DIM, HIDDEN, LAYERS = 64, 4, 16, 256, 2


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), names)
    return nnx.Param(init(rngs.params(), shape))


def _norm(rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        EMBED,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
        rngs=rngs,
    )


def attention(x, wq, wk, wv, wo, segment_ids=None):
    """Causal multi-head attention on ``x`` (batch, seq, embed); shared by all frameworks.

    ``shardplug.attention`` runs cuDNN's fused attention on a GPU where the inputs qualify
    (bfloat16) and XLA's otherwise; a parallelism that splits the sequence replaces it.
    ``segment_ids`` (batch, seq): packed documents, each token attending to its own only.
    """
    q = jnp.einsum("bse,ehd->bshd", x, wq)
    k = jnp.einsum("bse,ehd->bshd", x, wk)
    v = jnp.einsum("bse,ehd->bshd", x, wv)
    attended = fused_attention(q, k, v, causal=True, segment_ids=segment_ids)
    return jnp.einsum("bshd,hde->bse", attended, wo)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the reference transformer's mixtures route: ``top_k`` experts a token, and with a
    ``capacity_factor`` the capacity counted in ``capacity_groups`` runs of tokens."""

    top_k: int = 2
    capacity_factor: float | None = None
    capacity_groups: int = 1
    #: auxiliary-loss-free balancing: each step each expert's routing bias moves this much
    #: toward an even load (:func:`shardplug.moe.balance_bias`); None: no bias
    bias_rate: float | None = None


class RouterBias(nnx.Variable):
    """Each layer's routing bias, (layers, experts): model state, not trained."""


def balanced(bias: jax.Array, tallies: moe.Tally, rule: Rule) -> jax.Array:
    """The routing bias after this step's load (the stack's tallies)."""
    return moe.balance_bias(bias, tallies.kept, rule.bias_rate)


def mixture(x, router, experts_in, experts_out, rule: Rule, bias=None):
    """The MLP as a routed mixture of experts (:mod:`shardplug.moe`) on ``x`` (batch, seq,
    embed); shared by all frameworks. ``(out, aux)``: aux, this block's
    :class:`~shardplug.moe.Tally` (the losses and rows come from the stack's tallies)."""
    rows = x.reshape(-1, x.shape[-1])
    logits = rows @ router
    routing = moe.route(logits, rule.top_k, bias=bias)
    out, stats = moe.routed_experts(
        rows, routing, experts_in, experts_out, capacity_factor=rule.capacity_factor,
        capacity_groups=rule.capacity_groups, activation=jax.nn.gelu,
    )  # fmt: skip
    aux = moe.tally(logits, routing, stats)
    return out.reshape(x.shape), aux


def placed(table: jax.Array, tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
    """The learned position embeddings of ``tokens``: ``table``'s first rows, or, for
    packed documents, the rows of each token's ``positions`` (its place in its document:
    the positions restart at each); shared by all frameworks."""
    if positions is None:
        return table[None, : tokens.shape[1]]
    return jnp.take(table, positions, axis=0)


def packed_rows(segment_ids: jax.Array | None) -> dict[str, jax.Array] | None:
    """What a layer stack gives each block of packed documents (``rows=``: under ``pp``
    each microbatch's own): their ids, for attention; shared by all frameworks."""
    return None if segment_ids is None else {"segment_ids": segment_ids}


class Block(nnx.Module):
    def __init__(
        self,
        *,
        rngs: nnx.Rngs,
        experts: int = 0,
        rule: Rule = Rule(),
    ):
        self.norm1 = _norm(rngs)
        self.wq = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv"))
        self.wk = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv"))
        self.wv = _param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", "kv"))
        self.wo = _param(rngs, (HEADS, HEAD_DIM, EMBED), ("heads", "kv", "embed"))
        self.norm2 = _norm(rngs)
        self.experts, self.rule = experts, rule
        if experts:  # each expert an MLP of the dense one's size, stacked on "expert"
            self.router = _param(rngs, (EMBED, experts), ("embed", None))
            self.experts_in = _param(rngs, (experts, EMBED, HIDDEN), ("expert", "embed", "mlp"))
            self.experts_out = _param(rngs, (experts, HIDDEN, EMBED), ("expert", "mlp", "embed"))
        else:
            self.wi = _param(rngs, (EMBED, HIDDEN), ("embed", "mlp"))
            self.wf = _param(rngs, (HIDDEN, EMBED), ("mlp", "embed"))

    def __call__(self, x: jax.Array, bias: jax.Array | None = None, segment_ids=None):
        x = x + attention(self.norm1(x), self.wq[...], self.wk[...], self.wv[...], self.wo[...],
                          segment_ids)  # fmt: skip
        if not self.experts:
            return x + nnx.gelu(self.norm2(x) @ self.wi[...]) @ self.wf[...]
        out, aux = mixture(
            self.norm2(x), self.router[...], self.experts_in[...], self.experts_out[...],
            self.rule, bias,
        )  # fmt: skip
        return x + out, aux


class TransformerLM(nnx.Module):
    """Token and position embeddings, a stack of blocks, a final norm and an unembedding."""

    def __init__(
        self,
        *,
        rngs: nnx.Rngs,
        layers: int = LAYERS,
        remat: str = "none",
        sequence: int = synthetic.SEQ_LEN,
        experts: int = 0,
        **rule: object,
    ):
        self.embed = _param(rngs, (synthetic.VOCAB, EMBED), ("vocab", "embed"))
        self.position = _param(rngs, (sequence, EMBED), (None, "embed"))
        self.rule = Rule(**rule)
        moe_options = dict(experts=experts, rule=self.rule)
        self.blocks = stack.nnx_layers(lambda r: Block(rngs=r, **moe_options), layers, rngs)
        self.norm = _norm(rngs)
        self.unembed = _param(rngs, (EMBED, synthetic.VOCAB), ("embed", "vocab"))
        self.remat = remat
        self.router_bias = nnx.data(None)
        if experts and self.rule.bias_rate is not None:
            self.router_bias = RouterBias(jnp.zeros((layers, experts), jnp.float32))
        self.deterministic = False  # eval() sets it: the bias then stays as it is

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None):  # fmt: skip
        """The logits; with experts, ``(logits, tallies)``: each layer's routing tally, and
        with a routing bias ``(logits, tallies, bias)`` (the bias this step routed by).
        Packed documents: ``segment_ids`` (batch, seq), each token's document, keep its
        attention within it; ``positions``, its place there, restart the learned positions."""
        x = self.embed[...][tokens] + placed(self.position[...], tokens, positions)
        bias = None if self.router_bias is None else self.router_bias[...]
        x = stack.apply(self.blocks, x, remat=self.remat, per_layer=bias,
                        rows=packed_rows(segment_ids))  # fmt: skip
        if not isinstance(x, tuple):
            return self.norm(x) @ self.unembed[...]
        logits = self.norm(x[0]) @ self.unembed[...]
        if bias is None:
            return logits, x[1]
        if not self.deterministic:
            self.router_bias[...] = balanced(bias, x[1], self.rule)
        return logits, x[1], bias


def transformer(layers: int = LAYERS, remat: str = "none", sequence: int = synthetic.SEQ_LEN,
                **moe_options):  # fmt: skip
    """A function ``rngs -> TransformerLM`` of this depth, remat policy and length (and
    ``experts`` and :class:`Rule`'s ``top_k``, ``capacity_factor``, ``capacity_groups``)."""
    return lambda rngs: TransformerLM(rngs=rngs, layers=layers, remat=remat, sequence=sequence,
                                      **moe_options)  # fmt: skip


# The CNN: convolutions with BatchNorm, then dropout and a linear head.

CHANNELS, DROPOUT = 16, 0.25


class CNN(nnx.Module):
    """conv-BN-ReLU x2, 2x2 average pooling, dropout, linear; batch statistics as BatchStat."""

    def __init__(self, *, rngs: nnx.Rngs):
        conv = nnx.with_partitioning(_lecun, (None, None, None, "mlp"))
        # No bias before BatchNorm: it cancels, its gradient is rounding noise, and Adam
        # would turn that noise into full-size steps.
        self.conv1 = nnx.Conv(1, CHANNELS, (3, 3), use_bias=False, kernel_init=conv, rngs=rngs)
        self.norm1 = nnx.BatchNorm(CHANNELS, rngs=rngs)
        self.conv2 = nnx.Conv(
            CHANNELS, CHANNELS, (3, 3), use_bias=False, kernel_init=conv, rngs=rngs
        )
        self.norm2 = nnx.BatchNorm(CHANNELS, rngs=rngs)
        flat = (synthetic.IMAGE // 2) ** 2 * CHANNELS
        self.head = _dense(flat, synthetic.IMAGE_CLASSES, ("embed", None), rngs)
        self.rngs = rngs
        self.deterministic = False  # set by model.train() / model.eval()

    def __call__(self, images: jax.Array) -> jax.Array:
        # Inside a per-device program the batch statistics must span every device's rows.
        self.norm1.axis_name = self.norm2.axis_name = batch_axis_name()
        x = nnx.relu(self.norm1(self.conv1(images)))
        x = nnx.relu(self.norm2(self.conv2(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2)).reshape(images.shape[0], -1)
        if not self.deterministic:
            x = dropout(x, DROPOUT, self.rngs.dropout())
        return self.head(x)


def cnn(rngs: nnx.Rngs) -> CNN:
    return CNN(rngs=rngs)
