"""Every strategy x every reference model trains to the single-device loop's per-step losses."""

import numpy as np
import optax
import pytest
from reference import single_device_losses

import shardplug

STRATEGIES = ["dp", "fsdp", "2d", "pmap"]
MODELS = ["mlp", "classifier", "transformer"]
STEPS = 8
# float32, 8 devices: reductions run in another order than on one device.
RTOL = {"mlp": 1e-5, "classifier": 1e-5, "transformer": 1e-4}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def losses(model):
        if model not in cache:
            cache[model] = single_device_losses(model, STEPS)
        return cache[model]

    return losses


def train(strategy, model_name, steps=STEPS, **kwargs):
    model = shardplug.get_model(model_name)
    trainer = shardplug.Trainer(
        model.adapter("nnx"),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=strategy,
        **kwargs,
    )
    history = trainer.fit(model.batches(model.batch_size, 0), steps=steps)
    return trainer, [row["loss"] for row in history]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_like_one_device(strategy, model, reference):
    _, losses = train(strategy, model)
    expected = reference(model)
    np.testing.assert_allclose(losses, expected, rtol=RTOL[model])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_options_and_meshes_train_alike(strategy, reference):
    """A non-default mesh or option changes where arrays live, never the numbers."""
    options = {
        "dp": ("dp", {"devices": 4}),
        "fsdp": (shardplug.get_strategy("fsdp", min_size=0), {}),
        "2d": ("2d", {"mesh": "data=2,model=4"}),
        "pmap": ("pmap", {"devices": 2}),
    }
    chosen, kwargs = options[strategy]
    _, losses = train(chosen, "mlp", **kwargs)
    np.testing.assert_allclose(losses, reference("mlp"), rtol=RTOL["mlp"])
