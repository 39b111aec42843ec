"""Core's answers to the hooks a strategy or a parallelism leaves out, and the run's one
plugin manager that holds them.

Registered in every run's plugin manager with ``trylast``, so any strategy's implementation
is asked first. With only these, a run is data parallel on a mesh of one axis, named data.
"""

from __future__ import annotations

import sys

import jax
import pluggy
from jax.sharding import PartitionSpec as P

from shardplug.core import hookspecs
from shardplug.core.hookspecs import hookimpl
from shardplug.core.mesh import build_mesh

NAME = "shardplug.core.fallbacks"
#: the one axis of the mesh of a run without a strategy: every device on it, the batch's rows
#: split over it, so that the run is data parallel
AXIS = "data"


def new_manager() -> pluggy.PluginManager:
    """A run's plugin manager: the hook specs and these fallbacks; the strategy, its
    parallelisms and the add-ons are registered into it (one manager per run)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(sys.modules[__name__], name=NAME)
    return pm


@hookimpl(trylast=True)
def make_mesh(devices, mesh_shape):
    if mesh_shape is not None:
        return build_mesh(devices, mesh_shape, default=mesh_shape)
    return build_mesh(devices, None, default={AXIS: -1})


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


# The part hooks (asked of one parallelism of a composition at a time).


@hookimpl(trylast=True)
def split_param():
    return None


@hookimpl(trylast=True)
def gather_param(spec):
    return spec
