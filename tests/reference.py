"""The yardstick: each reference model trained by a plain single-device Flax NNX loop.

Written the way Flax's documentation writes a training loop (``nnx.Optimizer``, ``nnx.jit``)
and sharing no code with shardplug's trainer beyond the model, loss and data, so a strategy
that matches it trains like one device does.
"""

import jax
import optax
from flax import nnx

from shardplug import get_model


def single_device_losses(model_name: str, steps: int, seed: int = 0, batch_size=None):
    ref = get_model(model_name)
    with nnx.use_eager_sharding(False), jax.default_device(jax.devices()[0]):
        model = ref.builders["nnx"](nnx.Rngs(jax.random.key(seed)))
        optimizer = nnx.Optimizer(model, optax.adam(ref.learning_rate), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            def loss_of(model):
                out = ref.loss_fn(model, batch)
                return out[0] if isinstance(out, tuple) else out

            loss, grads = nnx.value_and_grad(loss_of)(model)
            optimizer.update(model, grads)
            return loss

        batches = ref.batches(batch_size or ref.batch_size, seed)
        return [float(step(model, optimizer, next(batches))) for _ in range(steps)]
