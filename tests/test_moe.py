"""The routed mixture of experts (shardplug.moe): the grouped product computes what a
dense loop over experts computes, capacity drops the late tokens, and the losses are the
papers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardplug import moe

TOKENS, WIDTH, HIDDEN, EXPERTS = 24, 8, 16, 4


def _weights(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (TOKENS, WIDTH))
    router = jax.random.normal(keys[1], (WIDTH, EXPERTS))
    w_in = jax.random.normal(keys[2], (EXPERTS, WIDTH, HIDDEN)) * 0.3
    w_gate = jax.random.normal(keys[3], (EXPERTS, WIDTH, HIDDEN)) * 0.3
    w_out = jax.random.normal(keys[4], (EXPERTS, HIDDEN, WIDTH)) * 0.3
    return x, router, w_in, w_gate, w_out


def _dense(x, routing, w_in, w_gate, w_out, kept=None):
    """Every expert on every token, then each token's chosen ones weighted: the reference."""
    every = jnp.einsum("td,edh->teh", x, w_in) * jax.nn.silu(jnp.einsum("td,edh->teh", x, w_gate))
    every = jnp.einsum("teh,ehd->ted", every, w_out)
    chosen = jnp.take_along_axis(every, routing.experts[..., None], axis=1)  # (t, k, d)
    weights = routing.weights if kept is None else routing.weights * kept
    return jnp.einsum("tkd,tk->td", chosen, weights)


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_experts_compute_what_the_dense_loop_computes(top_k):
    x, router, w_in, w_gate, w_out = _weights()

    def both(x, router, w_in, w_gate, w_out):
        routing = moe.route(x @ router, top_k)
        y, stats = moe.routed_experts(x, routing, w_in, w_out, w_gate=w_gate)
        return y, _dense(x, routing, w_in, w_gate, w_out), stats

    y, want, stats = both(x, router, w_in, w_gate, w_out)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert float(stats.dropped) == 0.0 and float(stats.load.sum()) == pytest.approx(1.0)
    grads = [
        jax.grad(lambda *a, i=i: jnp.sum(both(*a)[i] ** 2), argnums=(0, 1, 2, 3, 4))(
            x, router, w_in, w_gate, w_out
        )
        for i in (0, 1)
    ]  # through the router's weights too
    for got, ref in zip(*grads, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    x, router, w_in, w_gate, w_out = _weights(1)
    routing = moe.route(x @ router, 2)
    factor = 0.5
    cap = moe.capacity(TOKENS, 2, EXPERTS, factor)
    assert cap == 6  # ceil(0.5 * 24 * 2 / 4)
    expert = np.asarray(routing.experts).reshape(-1)
    taken, kept = dict.fromkeys(range(EXPERTS), 0), []
    for e in expert:  # tokens in order, each slot in order
        kept.append(taken[e] < cap)
        taken[e] += 1
    kept = np.asarray(kept).reshape(TOKENS, 2)
    y, stats = moe.routed_experts(x, routing, w_in, w_out, w_gate=w_gate, capacity_factor=factor)
    np.testing.assert_allclose(y, _dense(x, routing, w_in, w_gate, w_out, kept), atol=1e-6)
    assert float(stats.dropped) == pytest.approx(1 - kept.mean())
    counts = np.minimum(np.bincount(expert, minlength=EXPERTS), cap)
    np.testing.assert_allclose(stats.load, counts / counts.sum())


def test_capacity_groups_count_each_run_of_tokens_apart():
    x, router, w_in, w_gate, w_out = _weights(1)
    routing = moe.route(x @ router, 2)
    cap = moe.capacity(TOKENS // 3, 2, EXPERTS, 0.5)  # 3 groups of 8 tokens: 2 an expert
    expert = np.asarray(routing.experts).reshape(-1)
    kept = []
    for group in expert.reshape(3, -1):
        taken = dict.fromkeys(range(EXPERTS), 0)
        for e in group:
            kept.append(taken[e] < cap)
            taken[e] += 1
    kept = np.asarray(kept).reshape(TOKENS, 2)
    y, stats = moe.routed_experts(
        x, routing, w_in, w_out, w_gate=w_gate, capacity_factor=0.5, capacity_groups=3
    )
    np.testing.assert_allclose(y, _dense(x, routing, w_in, w_gate, w_out, kept), atol=1e-6)
    assert float(stats.dropped) == pytest.approx(1 - kept.mean()) and 0 < kept.mean() < 1
    with pytest.raises(ValueError, match="capacity_groups=5 must divide the 24 tokens"):
        moe.routed_experts(x, routing, w_in, w_out, capacity_factor=0.5, capacity_groups=5)


def test_the_auxiliary_losses_and_the_bias():
    logits = jnp.tile(jnp.eye(EXPERTS), (3, 1)) * 5.0  # each expert three tokens, confidently
    even = moe.route(logits, 1)
    probs = jax.nn.softmax(logits)
    assert float(moe.load_balancing_loss(even)) == pytest.approx(
        EXPERTS * np.sum(0.25 * np.asarray(probs.mean(0)))
    )
    one = moe.route(jnp.tile(jnp.array([9.0, 0, 0, 0]), (8, 1)), 1)
    assert float(moe.load_balancing_loss(one)) > 0.9 * EXPERTS  # one expert takes all
    z = moe.router_z_loss(logits)
    assert float(z) == pytest.approx(float(jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)))
    bias = moe.balance_bias(jnp.zeros(EXPERTS), jnp.array([0.7, 0.1, 0.1, 0.1]), rate=0.01)
    np.testing.assert_allclose(bias, [-0.01, 0.01, 0.01, 0.01])
    shifted = moe.route(jnp.tile(jnp.array([1.0, 0.9, 0, 0]), (2, 1)), 1, bias=bias * 10)
    assert shifted.experts[:, 0].tolist() == [1, 1] and float(shifted.weights[0, 0]) == 1.0
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and the 4 experts"):
        moe.route(logits, 5)
