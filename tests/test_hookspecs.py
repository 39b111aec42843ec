"""The hooks a parallelism needs beyond placement: owning the gradient computation and
placing the model state (per-device programs over many manual axes: test_compose.py)."""

import numpy as np
import pytest
from helpers import reference_trainer

import shardplug
from shardplug.core import registry
from tests.test_registry import install

PLUGINS = '''
import jax
import jax.numpy as jnp
from shardplug.plugin import Axis, P, hookimpl


class PythonMicrobatches:
    """Microbatches one after another in a Python loop: owns the gradient computation."""

    def __init__(self, count: int = 2):
        self.count = count
        self.calls = 0

    @hookimpl
    def parallel_axis(self):
        return Axis("loop", rank=15)

    @hookimpl
    def compute_grads(self, loss_and_grad, params, model_state, batch, rng):
        self.calls += 1
        outs = []
        for i in range(self.count):
            rows = jax.tree.map(lambda x: x[i :: self.count], batch)
            (loss, (metrics, model_state)), grads = loss_and_grad(
                params, model_state, rows, jax.random.fold_in(rng, i)
            )
            outs.append((loss, metrics, grads))
        mean = jax.tree.map(lambda *xs: sum(xs) / self.count, *outs)
        return (mean[0], (mean[1], model_state)), mean[2]


class BadGrads:
    """Returns the gradients alone from compute_grads."""

    @hookimpl
    def parallel_axis(self):
        return Axis("grads", rank=15)

    @hookimpl
    def compute_grads(self, loss_and_grad, params, model_state, batch, rng):
        return loss_and_grad(params, model_state, batch, rng)[1]


class BadState:
    """Answers shard_model_state with one spec for a whole tree."""

    @hookimpl
    def parallel_axis(self):
        return Axis("bad", rank=15)

    @hookimpl
    def shard_model_state(self, model_state):
        return [P()]
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    entry = {
        "loop": "hookplugs:PythonMicrobatches",
        "badstate": "hookplugs:BadState",
        "badgrads": "hookplugs:BadGrads",
    }
    install(tmp_path, monkeypatch, "hookplugs", "0.1", entry, {"hookplugs": PLUGINS})
    yield
    registry._discover.cache_clear()


def losses(strategy, mesh=None, model_name="mlp", **kwargs):
    model, trainer = reference_trainer(model_name, strategy, mesh=mesh, **kwargs)
    rows = trainer.fit(model.batches(model.batch_size, 0), steps=4)
    return trainer, [r["loss"] for r in rows]


def test_a_parallelism_that_owns_the_gradients_trains_like_core_accumulation(plugins):
    mine, got = losses(shardplug.get_strategy("dp+loop"), mesh="data=8,loop=1")
    assert mine.strategy.parts["loop"].calls == 1  # traced once, in the one compiled step
    _, expected = losses("dp", grad_accum=2)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    with pytest.raises(shardplug.PluginError, match=r"compute_grads must return \(\(loss"):
        losses(shardplug.get_strategy("dp+badgrads"), mesh="data=8,grads=1")


def test_model_state_shardings_come_from_the_hook_and_are_checked(plugins):
    _, cnn = losses("dp", model_name="cnn")  # the fallback: replicated batch statistics
    assert np.isfinite(cnn).all()
    with pytest.raises(shardplug.PluginError, match="shard_model_state returned a tree"):
        losses(shardplug.get_strategy("dp+badstate"), mesh="data=8,bad=1", model_name="cnn")
