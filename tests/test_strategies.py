"""One device trains like each framework's own plain single-device loop.

With the conformance suite (``test_conformance.py``: every strategy on 8 devices trains like
one device, over every adapter and reference model) this closes the matrix: every strategy x
every adapter x every reference model equals that framework's own single-device loop.
"""

import numpy as np
import optax
import pytest
from reference import single_device_losses

import shardplug
from shardplug.testing import conformance
from shardplug.testing.pytest_plugin import ADAPTERS, MODELS

STEPS = 5  # the conformance suite's default


def trainer_losses(strategy, adapter, model_name, **kwargs):
    model = shardplug.get_model(model_name)
    trainer = shardplug.Trainer(
        model.adapter(adapter),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=strategy,
        **kwargs,
    )
    return [r["loss"] for r in trainer.fit(model.batches(model.batch_size, 0), steps=STEPS)]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_one_device_trains_like_the_frameworks_own_loop(adapter, model):
    # the very trajectory the conformance suite compares every strategy against
    ours = conformance.one_device_losses(adapter, model, STEPS, 0)
    np.testing.assert_allclose(ours, single_device_losses(model, STEPS, adapter), rtol=1e-5)


def test_the_plugin_lists_what_the_code_has():
    assert tuple(shardplug.models.ADAPTERS) == ADAPTERS
    assert set(shardplug.models.MODELS) == set(MODELS)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap"])
def test_strategy_options_and_meshes_train_alike(strategy):
    """A non-default mesh or option changes where arrays live, never the numbers."""
    options = {
        "dp": ("dp", {"devices": 4}),
        "fsdp": (shardplug.get_strategy("fsdp", min_size=0), {}),
        "2d": ("2d", {"mesh": "data=4,model=2"}),
        "pmap": ("pmap", {"devices": 2}),
    }
    chosen, kwargs = options[strategy]
    np.testing.assert_allclose(
        trainer_losses(chosen, "nnx", "cnn", **kwargs),
        single_device_losses("cnn", STEPS, "nnx"),
        rtol=1e-4,
    )
