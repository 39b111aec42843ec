"""The optimizer's update of a traced step: on the devices, in host memory next to an
optimizer state kept there, or that state brought to the devices a parameter's at a time;
a judged step's left as it was where its loss or gradient is not finite."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardplug.core import memory
from shardplug.core.context import batch_axis_name


def updated(optimizer: optax.GradientTransformation, grads: Any, state: Any,
             given: Any, model_state: Any, finite: Any, *, placed: Any,
             axis: str | None, update_on_host: bool) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(params, opt_state, model_state)`` after the optimizer's update: on the devices,
    on the host (``update_on_host``), or brought a parameter's at a time (an optimizer
    state kept off the devices); each left as it was where ``finite`` (judged) is False."""

    def keeping(verdict: Any) -> Any:  # a judged step's: new where finite, else old
        return functools.partial(jax.tree.map, functools.partial(_keep_if_not, verdict))

    labels = None if update_on_host else _pieces(optimizer, grads, given.opt_state,
                                                 state.params, placed)  # fmt: skip
    if update_on_host or labels is not None:  # the optimizer state kept on the host
        if update_on_host:  # updated there: it never reaches the devices
            memory.on_devices_only(axis)
            keep = None if finite is None else keeping(
                jax.device_put(finite, jax.memory.Space.Host))  # fmt: skip
            params, opt_state = memory.update_on_host(optimizer, grads, state, given,
                                                      placed, keep)  # fmt: skip
        else:  # brought to the devices a parameter's at a time
            params_off = jax.tree.map(memory.off_devices, placed.params)
            params = jax.tree.map(lambda now, held, off: held if off else now, state.params,
                                  given.params, params_off)  # fmt: skip
            state_off = [memory.off_devices(s) for s in jax.tree.leaves(placed.opt_state)]
            params, opt_state = memory.update_in_pieces(
                optimizer, grads, params, given.opt_state, labels,
                None if finite is None else keeping(finite), params_off, state_off,
            )  # fmt: skip
        if finite is not None:
            model_state = keeping(finite)(model_state, state.model_state)
        return params, opt_state, model_state
    state = memory.brought(state, placed, axis, "opt_state")  # for the update alone
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = memory.applied(state.params, updates)
    if finite is not None:
        params, opt_state, model_state = jax.tree.map(
            functools.partial(_keep_if_not, finite),
            (params, opt_state, model_state),
            (state.params, state.opt_state, state.model_state),
        )
    return params, opt_state, model_state


def _pieces(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
            placed: Any) -> list[int] | None:  # fmt: skip
    """Where the optimizer state kept off the devices is brought to them for the update
    one parameter's at a time (:func:`shardplug.core.memory.update_in_pieces`): each state
    leaf's parameter; None to bring it whole (``update_on_host`` asks neither)."""
    if placed is None or not memory.any_off(placed.opt_state):
        return None
    if batch_axis_name() is not None:
        return None  # a per-device program: refused where the state is brought
    return memory.leafwise(optimizer, grads, opt_state, params)


def _keep_if_not(finite: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        return new
    return jnp.where(finite, new, old)
