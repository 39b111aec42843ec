"""Core's answers to the hooks a strategy leaves out.

Registered in every run's plugin manager with ``trylast``, so any strategy's implementation
is asked first. With only these, a run is data parallel on a one-axis ``data`` mesh.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.hookspecs import hookimpl
from shardplug.core.mesh import build_mesh


@hookimpl(trylast=True)
def make_mesh(devices, mesh_shape):
    if mesh_shape is not None:
        return build_mesh(devices, mesh_shape, default=mesh_shape)
    return build_mesh(devices, None, default={"data": -1})


@hookimpl(trylast=True)
def shard_params(params):
    return jax.tree.map(lambda _: P(), params)


@hookimpl(trylast=True)
def shard_batch(batch, mesh):
    every_axis = tuple(mesh.axis_names)
    return jax.tree.map(lambda leaf: P(every_axis) if leaf.ndim else P(), batch)


@hookimpl(trylast=True)
def shard_model_state(model_state):
    return jax.tree.map(lambda _: P(), model_state)


@hookimpl(trylast=True)
def gather_params(params):
    return params


@hookimpl(trylast=True)
def reduce_grads(grads):
    return grads


@hookimpl(trylast=True)
def compile_step(step_fn, state_shardings, batch_shardings):
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )


@hookimpl(trylast=True)
def encode_grads(grads):
    return grads
