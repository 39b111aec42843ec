"""A user's own model in each framework, with their own loss and optimizer, trains under
every strategy to the per-step losses of their own plain single-device loop."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplug

STRATEGIES = ["dp", "fsdp", "2d", "pmap"]
STEPS = 10


def batches():
    rng = np.random.default_rng(7)
    for _ in range(STEPS):
        x = rng.normal(size=(64, 8)).astype(np.float32)
        yield {"x": x, "y": np.sin(x).sum(axis=1, keepdims=True)}


def optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def trained(adapter, loss_fn, strategy):
    trainer = shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optimizer(), strategy=strategy, log_every=4
    )
    return [r["loss"] for r in trainer.fit(batches(), steps=STEPS)]


# Flax NNX


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 64, rngs=rngs)
        self.b = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_loop():
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt, b)) for b in batches()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nnx_user_model(strategy):
    losses = trained(shardplug.from_nnx(NnxNet(nnx.Rngs(0))), nnx_loss, strategy)
    np.testing.assert_allclose(losses, nnx_loop(), rtol=1e-5)


# Flax Linen


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=True):
        x = nn.Dropout(0.5, deterministic=deterministic)(jnp.tanh(nn.Dense(64)(x)))
        return nn.Dense(1)(x)


def linen_loss(model, batch):
    return jnp.mean((model(batch["x"], deterministic=True) - batch["y"]) ** 2)


def linen_loop(variables):
    module, tx = LinenNet(), optimizer()
    params = variables["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for b in batches():
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linen_user_model_with_their_own_variables(strategy):
    variables = LinenNet().init(jax.random.key(3), jnp.zeros((1, 8)))
    expected = linen_loop(variables)
    losses = trained(shardplug.from_linen(LinenNet(), variables=variables), linen_loss, strategy)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)  # the loss their loop printed


def test_linen_user_key_gives_their_initialisation():
    variables = LinenNet().init(jax.random.key(3), jnp.zeros((1, 8)))
    adapter = shardplug.from_linen(LinenNet(), jnp.zeros((1, 8)), rng=jax.random.key(3))
    losses = trained(adapter, linen_loss, "fsdp")
    np.testing.assert_allclose(losses, linen_loop(variables), rtol=1e-5)


def test_linen_partition_metadata_becomes_annotations():
    class Annotated(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            x = nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            return nn.Dense(8, kernel_init=nn.with_partitioning(init, ("mlp", None)))(x)

    adapter = shardplug.from_linen(Annotated(), jnp.zeros((1, 16)))
    trainer = shardplug.Trainer(
        adapter, loss_fn=lambda m, b: jnp.mean(m(b)), optimizer=optax.sgd(0.1), strategy="2d"
    )
    assert trainer.param_shardings["Dense_0"]["kernel"].spec == P(None, "model")
    assert trainer.param_shardings["Dense_1"]["kernel"].spec == P("model")
    assert trainer.param_shardings["Dense_1"]["bias"].spec == P()


# Equinox


def eqx_loss(model, batch):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def eqx_loop(model):
    tx = optimizer()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(eqx_loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for b in batches():
        model, opt_state, loss = step(model, opt_state, b)
        losses.append(float(loss))
    return losses


def eqx_net():
    return eqx.nn.MLP(8, 1, 64, 1, activation=jnp.tanh, key=jax.random.key(5))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_equinox_user_model(strategy):
    rules = {r"layers/0/weight": ("mlp", None), r"layers/1/weight": (None, "mlp")}
    losses = trained(shardplug.from_equinox(eqx_net(), rules=rules), eqx_loss, strategy)
    np.testing.assert_allclose(losses, eqx_loop(eqx_net()), rtol=1e-5)


def test_equinox_trains_inexact_arrays_and_keeps_the_rest_static():
    trainer = shardplug.Trainer(
        shardplug.from_equinox(eqx_net()), loss_fn=eqx_loss, optimizer=optimizer()
    )
    trainer.fit(batches(), steps=3)
    model = trainer.model
    assert isinstance(model, eqx.nn.MLP)
    assert model.activation is jnp.tanh and model.depth == 1
    assert len(jax.tree.leaves(trainer.state.params)) == 4  # two weights, two biases
    assert not np.allclose(model.layers[0].weight, eqx_net().layers[0].weight)
