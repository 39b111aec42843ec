"""The matrix: every strategy x every adapter x every reference model trains to the per-step
losses of that framework's plain single-device loop."""

import functools

import numpy as np
import optax
import pytest
from reference import single_device_losses

import shardplug

STRATEGIES = ["dp", "fsdp", "2d", "pmap"]
ADAPTERS = ["nnx", "linen", "equinox"]
MODELS = ["mlp", "classifier", "transformer", "cnn"]
STEPS = 6
# float32 on 8 devices: reductions run in another order than on one device.
RTOL = {"mlp": 1e-5, "classifier": 1e-5, "transformer": 1e-4, "cnn": 1e-4}


@functools.cache
def reference(adapter, model):
    return single_device_losses(model, STEPS, adapter)


def train(strategy, adapter, model_name, steps=STEPS, **kwargs):
    model = shardplug.get_model(model_name)
    trainer = shardplug.Trainer(
        model.adapter(adapter),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=strategy,
        **kwargs,
    )
    history = trainer.fit(model.batches(model.batch_size, 0), steps=steps)
    return trainer, [row["loss"] for row in history]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_like_one_device(strategy, adapter, model):
    _, losses = train(strategy, adapter, model)
    np.testing.assert_allclose(losses, reference(adapter, model), rtol=RTOL[model])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_options_and_meshes_train_alike(strategy):
    """A non-default mesh or option changes where arrays live, never the numbers."""
    options = {
        "dp": ("dp", {"devices": 4}),
        "fsdp": (shardplug.get_strategy("fsdp", min_size=0), {}),
        "2d": ("2d", {"mesh": "data=2,model=4"}),
        "pmap": ("pmap", {"devices": 2}),
    }
    chosen, kwargs = options[strategy]
    _, losses = train(chosen, "nnx", "cnn", **kwargs)
    np.testing.assert_allclose(losses, reference("nnx", "cnn"), rtol=RTOL["cnn"])
