"""The training state's first arrays: built in their shardings, or only described."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.sharding import optimizer_shardings
from shardplug.core.step import TrainState


def state_shardings(
    strategy: Any, mesh: Any, optimizer: Any, params: Any, model_state: Any, annotations: Any
) -> TrainState:
    """Every state array's ``NamedSharding`` on ``mesh``, as ``strategy`` lays out the
    (abstract) ``params`` and ``model_state``; the optimizer's state follows its parameter;
    each in the memory the strategy's ``place_state`` chooses (the devices' by default)."""
    replicated = NamedSharding(mesh, P())
    placed = strategy.shard_params(params, mesh, annotations)
    laid_out = TrainState(
        step=replicated,
        params=placed,
        opt_state=optimizer_shardings(optimizer, params, placed, replicated),
        model_state=strategy.shard_model_state(model_state, mesh),
        rng=replicated,
    )
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(optimizer.init, params),
        model_state=model_state,
        rng=jax.eval_shape(lambda: jax.random.key(0)),
    )
    return strategy.place_state(laid_out, abstract, mesh)


def create_state(
    adapter: Any, optimizer: Any, shardings: TrainState, rng: jax.Array, *, allocate: bool = True
) -> TrainState:
    """The state a run starts from, its arrays in ``shardings``.

    A model the adapter builds (no ``variables``) is built inside one jit whose outputs are
    the strategy's shardings: no device ever holds a full copy of a sharded parameter. A model
    that already exists is copied once into the shardings, never aliased: the step donates
    its state, and the caller's arrays must stay valid and unchanged.

    With ``allocate=False`` nothing is computed or allocated: the leaves are
    ``jax.ShapeDtypeStruct`` with their shardings, enough to lower and compile the step (to
    plan a model larger than the host's memory).
    """

    def create(rng):
        params, model_state = adapter.init(rng)
        return TrainState(
            jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state, rng
        )

    if not allocate:
        if adapter.variables is None:
            shapes = jax.eval_shape(create, rng)
        else:
            params, model_state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                adapter.variables,
            )
            opt_state = jax.eval_shape(optimizer.init, params)
            step = jax.ShapeDtypeStruct((), jnp.int32)
            shapes = TrainState(step, params, opt_state, model_state, jax.eval_shape(lambda: rng))
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )
    if adapter.weights is not None and adapter.variables is None:  # read into place
        params = adapter.weights(shardings.params)
        model_state = jax.jit(lambda r: adapter.init(r)[1], out_shardings=shardings.model_state)(
            rng
        )
        opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
        step, rng = _step_and_rng(rng, shardings)
        return TrainState(step, params, opt_state, model_state, rng)
    if adapter.variables is None:
        return jax.jit(create, out_shardings=shardings)(rng)
    # A jit's outputs are new buffers; device_put alone, even with may_alias=False, hands
    # device 0 the caller's own buffer when it replicates a one-device array (jax 0.10).
    placed = (shardings.params, shardings.model_state)
    params, model_state = jax.jit(lambda v: jax.tree.map(jnp.copy, v), out_shardings=placed)(
        jax.device_put(adapter.variables, placed)
    )
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step, rng = _step_and_rng(rng, shardings)
    return TrainState(step, params, opt_state, model_state, rng)


def _step_and_rng(rng: jax.Array, shardings: TrainState) -> tuple[jax.Array, jax.Array]:
    """Step 0 and the key in their shardings: made by a jit, which (unlike ``device_put``)
    places them on devices of other processes too."""
    return jax.jit(lambda r: (jnp.zeros((), jnp.int32), r),
                   out_shardings=(shardings.step, shardings.rng))(rng)  # fmt: skip
