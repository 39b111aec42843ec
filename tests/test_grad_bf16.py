"""The built-in ``grad-bf16`` add-on composes with every strategy.

With it, each device's gradient is rounded to bfloat16 and the reduction across devices sums
bfloat16: the program asks for half the gradient bytes. The numbers stay those of training
on one device, up to bfloat16's rounding of the gradient.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import reference_trainer

import shardplug
from shardplug.core.compiled.hlo import collectives, partitioned_hlo
from shardplug.testing import conformance

STRATEGIES = ["dp", "fsdp", "2d", "pmap"]
STEPS = 5


def trainer_for(strategy, model_name, optimizer=None, addons=("grad-bf16",), adapter="nnx"):
    addons = list(addons)
    return reference_trainer(
        model_name, shardplug.get_strategy(strategy, addons=addons), adapter=adapter,
        optimizer=optimizer,
    )  # fmt: skip


def keep_gradients() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient it was given, exactly."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def test_it_is_a_builtin_addon():
    (info,) = [a for a in shardplug.list_addons() if a.name == "grad-bf16"]
    assert info.builtin and info.hooks == ("encode_grads",)
    assert shardplug.get_strategy("fsdp", addons=["grad-bf16"]).encodes_grads
    assert not shardplug.get_strategy("fsdp").encodes_grads


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_reduced_gradient_is_bfloat16_and_close_to_float32(strategy):
    model, plain = trainer_for(strategy, "cnn", keep_gradients(), addons=())
    _, rounded = trainer_for(strategy, "cnn", keep_gradients())
    batch = next(model.batches(model.batch_size, 0))
    plain.fit([batch], 1)
    rounded.fit([batch], 1)
    exact = jax.device_get(plain.state.opt_state)
    got = jax.device_get(rounded.state.opt_state)
    for g, g32 in zip(jax.tree.leaves(got), jax.tree.leaves(exact), strict=True):
        assert g.dtype == np.float32  # decoded for the optimizer
        np.testing.assert_array_equal(g, g.astype(jnp.bfloat16).astype(np.float32))
        # per-device roundings of 2**-9 each, then one of the sum
        scale = np.abs(g32).max()
        np.testing.assert_allclose(g, g32, rtol=1e-2, atol=1e-2 * scale)
    # ...and the rounding did happen
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(exact), strict=True)
    assert any(not np.array_equal(a, b) for a, b in pairs)
    # the shardings are the strategy's, unchanged by the add-on
    assert jax.tree.leaves(rounded.param_shardings) == jax.tree.leaves(plain.param_shardings)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_it_trains_like_one_device_in_float32(strategy):
    # the CNN: batch statistics and dropout must still be those of the global batch
    model, trainer = trainer_for(strategy, "cnn")
    losses = [r["loss"] for r in trainer.fit(model.batches(model.batch_size, 0), STEPS)]
    reference = conformance.one_device_losses("nnx", "cnn", STEPS, 0)
    np.testing.assert_allclose(losses, reference, rtol=2e-3)

    _, exact = trainer_for(strategy, "cnn", addons=())
    exact.fit(model.batches(model.batch_size, 0), STEPS)
    statistics = 0
    for ours, theirs in zip(
        jax.tree.leaves(trainer.state.model_state),
        jax.tree.leaves(exact.state.model_state),
        strict=True,
    ):
        if jnp.issubdtype(ours.dtype, jnp.floating):  # the running means and variances
            # per-shard statistics would make the running variances some 5% smaller here
            # (8-row shards lose the variance of the shard means); bf16 gradients move the
            # weights, and so the statistics, by well under 1%
            np.testing.assert_allclose(ours, theirs, rtol=1e-2, atol=1e-3)
            statistics += 1
    assert statistics == 4


def reductions(hlo: str) -> dict[str, int]:
    found = {"f32": 0, "bf16": 0}
    for c in collectives(hlo):
        if c.kind in ("all-reduce", "reduce-scatter"):
            found[c.dtype] = found.get(c.dtype, 0) + c.bytes
    return found


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_program_reduces_the_gradients_in_half_the_bytes(strategy):
    model, plain = trainer_for(strategy, "mlp", addons=())
    _, rounded = trainer_for(strategy, "mlp")
    batch = next(model.batches(model.batch_size, 0))
    before = reductions(partitioned_hlo(plain.lower(batch)))
    after = reductions(partitioned_hlo(rounded.lower(batch)))
    assert before["bf16"] == 0 < after["bf16"]
    # the same reductions; the gradients' now in bfloat16, at half the bytes (give or take a
    # few float32 scalars: the loss, and the gradient norm of the finite check, which the
    # partitioner may reduce in another place)
    assert abs(after["f32"] + 2 * after["bf16"] - before["f32"]) <= 4 * 4
    # ...and those are at least each device's share of the gradient
    per_device = sum(
        math.prod(s.shard_shape(p.shape)) * 4
        for p, s in zip(
            jax.tree.leaves(rounded.state.params),
            jax.tree.leaves(rounded.param_shardings),
            strict=True,
        )
    )
    assert 2 * after["bf16"] >= per_device


def test_it_trains_from_the_command_line(tmp_path, capsys):
    from shardplug.cli import main

    out = tmp_path / "m.jsonl"
    argv = ["train", "--addon", "grad-bf16", "--strategy", "fsdp", "--model", "mlp"]
    assert main([*argv, "--steps", "3", "--quiet", "--metrics-out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3


def test_a_misbehaving_encoder_is_named():
    class Reshaper:
        @shardplug.hookimpl
        def encode_grads(self, grads):
            return jax.tree.map(lambda g: g.reshape(-1), grads)

    from shardplug.core.registry import Strategy, StrategyInfo

    info = StrategyInfo("reshaper", "test", "tests", "0", (), ("encode_grads",))
    strategy = Strategy(info, Reshaper())
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1), strategy=strategy
    )
    with pytest.raises(shardplug.errors.PluginError, match="encode_grads must return"):
        trainer.compile(next(model.batches(model.batch_size, 0)))
