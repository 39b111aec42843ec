"""Model state and randomness: batch statistics and dropout that do not depend on the
device count or the strategy, evaluation that updates nothing, and the per-step key."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplug

CNN = shardplug.get_model("cnn")


def cnn_trainer(strategy="dp", adapter="nnx", **kwargs):
    return shardplug.Trainer(
        CNN.adapter(adapter),
        loss_fn=CNN.loss_fn,
        optimizer=optax.adam(CNN.learning_rate),
        strategy=strategy,
        **kwargs,
    )


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
def test_batch_statistics_do_not_depend_on_devices_or_strategy(adapter):
    runs = {}
    for strategy, devices in [("dp", 1), ("dp", 8), ("pmap", 8), ("fsdp", 8)]:
        trainer = cnn_trainer(strategy, adapter, devices=devices)
        trainer.fit(CNN.batches(64, 0), steps=4)
        runs[strategy, devices] = leaves(trainer.state.model_state)
    one = runs["dp", 1]
    assert one and not all(np.allclose(x, 0) or np.allclose(x, 1) for x in one)  # they moved
    for key, stats in runs.items():
        for a, b in zip(stats, one, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(key))


def test_pmap_leaves_model_state_the_same_on_every_device():
    trainer = cnn_trainer("pmap")
    trainer.fit(CNN.batches(64, 0), steps=3)
    for array in jax.tree.leaves(trainer.state.model_state):
        if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
            array = jax.random.key_data(array)
        shards = [np.asarray(s.data) for s in array.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
def test_dropout_masks_do_not_depend_on_the_device_count(adapter):
    losses = {}
    for strategy, devices in [("dp", 1), ("pmap", 2), ("pmap", 8)]:
        trainer = cnn_trainer(strategy, adapter, devices=devices)
        losses[strategy, devices] = [r["loss"] for r in trainer.fit(CNN.batches(64, 0), steps=4)]
    for run in losses.values():
        np.testing.assert_allclose(run, losses["dp", 1], rtol=1e-4)


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
def test_dropout_draws_a_new_mask_every_step(adapter):
    # learning rate 0 and one batch again and again: only the dropout mask can change the loss
    trainer = shardplug.Trainer(
        CNN.adapter(adapter), loss_fn=CNN.loss_fn, optimizer=optax.sgd(0.0), strategy="dp"
    )
    batch = next(CNN.batches(64, 0))
    losses = [r["loss"] for r in trainer.fit([batch] * 4, steps=4)]
    assert len(set(losses)) == 4
    evaluated = {trainer.evaluate([batch])["loss"] for _ in range(2)}
    assert len(evaluated) == 1


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
def test_evaluate_updates_nothing_and_turns_dropout_off(adapter):
    trainer = cnn_trainer("fsdp", adapter)
    trainer.fit(CNN.batches(64, 0), steps=5)
    before = leaves(trainer.state)
    first = trainer.evaluate(CNN.batches(64, 100), steps=3)
    second = trainer.evaluate(CNN.batches(64, 100), steps=3)
    assert first == second  # no dropout, no statistics updated
    for a, b in zip(before, leaves(trainer.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(first) == {"loss", "accuracy"}
    assert int(trainer.state.step) == 5


def test_evaluate_is_the_same_for_every_strategy_and_follows_training():
    results = {}
    for strategy in ["dp", "fsdp", "2d", "pmap"]:
        trainer = cnn_trainer(strategy)
        untrained = trainer.evaluate(CNN.batches(128, 100), steps=2)
        trainer.fit(CNN.batches(64, 0), steps=30)
        results[strategy] = trainer.evaluate(CNN.batches(128, 100), steps=2)
        assert results[strategy]["loss"] < untrained["loss"]
    for result in results.values():
        assert result["loss"] == pytest.approx(results["dp"]["loss"], rel=1e-4)
        assert result["accuracy"] == pytest.approx(results["dp"]["accuracy"], abs=1e-6)


def test_loss_fn_receives_the_documented_step_key():
    seen = []

    def loss_fn(model, batch, rng):
        return CNN.loss_fn(model, batch)[0], {"draw": jax.random.uniform(rng)}

    trainer = shardplug.Trainer(
        CNN.adapter("nnx"), loss_fn=loss_fn, optimizer=optax.sgd(0.01), seed=3, strategy="pmap"
    )
    seen = [r["draw"] for r in trainer.fit(CNN.batches(64, 0), steps=3)]
    expected = [
        float(jax.random.uniform(jax.random.fold_in(jax.random.key(3), s))) for s in range(3)
    ]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)


def test_evaluate_needs_batches():
    with pytest.raises(shardplug.ConfigError, match="evaluate got no batches"):
        cnn_trainer().evaluate([])
