"""An explicit per-device program, as ``jax.pmap`` writes it, on ``jax.shard_map``.

Each device runs the step on its own slice of the batch with its own copy of the parameters;
the gradients and metrics are averaged with ``lax.pmean``. Outside the step the state is an
ordinary replicated global array, exactly as under ``dp``, so checkpoints and reports treat
both alike.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.plugin import Capability, build_mesh, hookimpl, per_device_program

AXIS = "data"


def _mean_if_float(x):
    return jax.lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x


class PerDeviceProgram:
    """Per-device program (pmap style): replicated state, gradients averaged with lax.pmean."""

    #: how bench writes this strategy's step by hand: a jax.shard_map per-device program
    baseline = "shard_map"
    unsupported: ClassVar[dict[str, str]] = {
        Capability.EXPLICIT_AXES: "its step is a per-device program, in which every mesh axis "
        "is manual: a model's explicit shardings (reshard, out_sharding) cannot name them"
    }

    @hookimpl
    def make_mesh(self, devices, mesh_shape):
        return build_mesh(devices, mesh_shape, default={AXIS: -1})

    @hookimpl
    def shard_params(self, params):
        return jax.tree.map(lambda _: P(), params)

    @hookimpl
    def shard_batch(self, batch):
        return jax.tree.map(lambda leaf: P(AXIS) if leaf.ndim else P(), batch)

    @hookimpl
    def reduce_grads(self, grads):
        return jax.lax.pmean(grads, AXIS)

    @hookimpl
    def compile_step(self, step_fn, mesh, state_shardings, batch_shardings):
        def per_device(state, batch):
            # models see batch_axis_name() == "data"; every mesh axis is manual here
            with per_device_program(AXIS, manual=tuple(mesh.axis_names)):
                state, metrics = step_fn(state, batch)
            # Batch statistics computed from each device's rows are averaged, so the state
            # leaves the program the same on every device.
            model_state = jax.tree.map(_mean_if_float, state.model_state)
            return state._replace(model_state=model_state), jax.lax.pmean(metrics, AXIS)

        def specs(tree):
            return jax.tree.map(lambda s: s.spec, tree)

        # check_vma=False keeps pmap's semantics: a device's gradient is that of its own
        # shard, and reduce_grads above is what averages it.
        program = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs(state_shardings), specs(batch_shardings)),
            out_specs=(specs(state_shardings), P()),
            check_vma=False,
        )
        return jax.jit(program, donate_argnums=0)
