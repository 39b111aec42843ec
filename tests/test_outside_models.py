"""Models nobody here wrote, trained under every strategy, equal to their own one-device loops.

- Flax NNX: the CNN of Flax's MNIST tutorial (flax.readthedocs.io, "MNIST tutorial");
- Flax Linen: the CNN of Flax's ``examples/mnist``;
- Equinox: ``eqx.nn.MLP``, from the library itself.

They carry no sharding annotations: tensor parallelism has nothing to split in them and
leaves them whole; the rest split them as they split any model.
"""

from functools import partial

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplug

STRATEGIES = ["dp", "fsdp", "2d", "pmap", "fsdp+tp", "dp+fsdp"]
STEPS, ROWS = 3, 16


class NnxCNN(nnx.Module):
    """Flax's NNX MNIST tutorial, as written there."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.linear1(x))
        x = self.linear2(x)
        return x


class LinenCNN(nn.Module):
    """Flax's examples/mnist model, as written there."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def images():
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(ROWS, 28, 28, 1)).astype(np.float32),
            "label": rng.integers(0, 10, ROWS).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def vectors():
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(ROWS, 12)).astype(np.float32),
         "y": rng.normal(size=(ROWS, 3)).astype(np.float32)}
        for _ in range(STEPS)
    ]  # fmt: skip


def cross_entropy(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def eqx_mse(model, batch):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


OPTIMIZER = optax.adam(1e-3)


def nnx_own_loop(batches):
    model = NnxCNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, b)) for b in batches]


def linen_own_loop(batches):
    module = LinenCNN()
    params = module.init(jax.random.key(0), batches[0]["image"])["params"]
    opt_state = OPTIMIZER.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_of(params):
            return cross_entropy(lambda x: module.apply({"params": params}, x), batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


def eqx_own_loop(batches):
    model = eqx.nn.MLP(12, 3, 64, 2, key=jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(eqx_mse)(model, batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for batch in batches:
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(float(loss))
    return losses


CASES = {
    "nnx": (lambda: shardplug.from_nnx(NnxCNN(rngs=nnx.Rngs(0))), cross_entropy, images,
            nnx_own_loop),
    "linen": (lambda: shardplug.from_linen(LinenCNN(), images()[0]["image"],
                                           rng=jax.random.key(0)), cross_entropy, images,
              linen_own_loop),
    "equinox": (lambda: shardplug.from_equinox(eqx.nn.MLP(12, 3, 64, 2, key=jax.random.key(0))),
                eqx_mse, vectors, eqx_own_loop),
}  # fmt: skip


@pytest.fixture(scope="module")
def own_losses():
    """Each model's own loop on one device (computed once)."""
    with jax.default_device(jax.devices()[0]):
        return {name: case[3](case[2]()) for name, case in CASES.items()}


@pytest.mark.parametrize("framework", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_outside_model_trains_like_its_own_loop(framework, strategy, own_losses):
    adapter, loss_fn, data, _ = CASES[framework]
    trainer = shardplug.Trainer(adapter(), loss_fn=loss_fn, optimizer=OPTIMIZER, strategy=strategy)
    losses = [r["loss"] for r in trainer.fit(data(), STEPS)]
    np.testing.assert_allclose(losses, own_losses[framework], rtol=1e-4)
