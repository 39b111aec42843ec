"""The yardstick: each reference model trained by a plain single-device loop, per framework.

Written the way each framework's documentation writes a training loop (NNX: ``nnx.Optimizer``
and ``nnx.jit``; Linen: ``module.apply`` with mutable ``batch_stats``; Equinox:
``eqx.filter_jit`` and ``eqx.filter_value_and_grad``), sharing nothing with shardplug's trainer
beyond the model, the loss and the data. A strategy that matches it trains like one device.
Step ``s`` draws its randomness from ``jax.random.fold_in(jax.random.key(seed), s)``, the key
shardplug documents.
"""

import equinox as eqx
import flax.linen as nn
import jax
import optax
from flax import nnx

from shardplug import get_model
from shardplug.models import equinox_models, linen_models, nnx_models

NNX = {
    "mlp": nnx_models.regressor,
    "classifier": nnx_models.classifier,
    "transformer": nnx_models.transformer(),
    "cnn": nnx_models.cnn,
}
EQX = {
    "mlp": equinox_models.regressor,
    "classifier": equinox_models.classifier,
    "transformer": equinox_models.transformer(),
    "cnn": equinox_models.cnn,
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def nnx_losses(name, steps, seed=0):
    ref = get_model(name)
    with nnx.use_eager_sharding(False):
        model = NNX[name](nnx.Rngs(jax.random.key(seed)))
    optimizer = nnx.Optimizer(model, optax.adam(ref.learning_rate), wrt=nnx.Param)
    model.train()

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_of(model):
            return _first(ref.loss_fn(model, batch, rng=None, train=True, state=None))

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss

    batches = ref.batches(ref.batch_size, seed)
    return [float(step(model, optimizer, next(batches))) for _ in range(steps)]


def linen_losses(name, steps, seed=0):
    ref = get_model(name)
    module = linen_models.MODULES[name]
    key = jax.random.key(seed)
    variables = nn.unbox(module.init(key, linen_models.sample_input(name)))
    params = variables.pop("params")
    tx = optax.adam(ref.learning_rate)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, stats, batch, i):
        def loss_of(params):
            out, updated = module.apply(
                {"params": params, **stats},
                batch[ref.inputs],
                train=True,
                rngs={"dropout": jax.random.fold_in(jax.random.fold_in(key, i), 0)},
                mutable=list(stats),
            )
            return ref.head(out, batch)[0], updated

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats, loss

    batches, losses = ref.batches(ref.batch_size, seed), []
    for i in range(steps):
        params, opt_state, variables, loss = step(params, opt_state, variables, next(batches), i)
        losses.append(float(loss))
    return losses


def equinox_losses(name, steps, seed=0):
    ref = get_model(name)
    key = jax.random.key(seed)
    built = EQX[name](key)
    model, state = built if isinstance(built, tuple) else (built, None)
    tx = optax.adam(ref.learning_rate)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state, batch, i):
        @eqx.filter_value_and_grad(has_aux=True)
        def loss_of(model):
            out = ref.loss_fn(model, batch, rng=jax.random.fold_in(key, i), train=True, state=state)
            return out[0], (out[2] if len(out) == 3 else None)

        (loss, state), grads = loss_of(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    batches, losses = ref.batches(ref.batch_size, seed), []
    for i in range(steps):
        model, state, opt_state, loss = step(model, state, opt_state, next(batches), i)
        losses.append(float(loss))
    return losses


LOOPS = {"nnx": nnx_losses, "linen": linen_losses, "equinox": equinox_losses}


def single_device_losses(name, steps, adapter="nnx", seed=0):
    with jax.default_device(jax.devices()[0]):
        return LOOPS[adapter](name, steps, seed)
