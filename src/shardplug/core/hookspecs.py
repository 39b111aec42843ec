"""The hook specifications: the whole contract between the trainer and a strategy.

The trainer owns the loop. A strategy decides only where arrays live and how devices meet,
by implementing some of the hooks below. Each hook is called with keyword arguments and is
``firstresult``: the strategy's implementation wins, and core's fallback (in
:mod:`shardplug.core.fallbacks`) answers whatever the strategy leaves out. An implementation
may accept fewer arguments than the spec names, as pluggy allows.

A strategy is an ordinary Python object whose methods carry ``@shardplug.hookimpl``,
published under the entry-point group ``shardplug``; the entry point's name is the
strategy's name. If the object is a class, ``get_strategy(name, **options)`` instantiates it
with the options as keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy

PROJECT = "shardplug"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def make_mesh(devices: Sequence[Any], mesh_shape: dict[str, int] | None) -> Any:
    """Arrange the devices into the mesh this strategy wants.

    Called once at set-up, before any array is created.

    :param devices: the devices of the run, in order (``jax.devices()`` or the first D of them).
    :param mesh_shape: the axis sizes the user asked for (``--mesh data=2,model=4`` gives
        ``{"data": 2, "model": 4}``), or None when they asked for nothing.
    :return: a ``jax.sharding.Mesh`` over exactly these devices. Raise
        :class:`shardplug.errors.MeshError` when ``mesh_shape`` names axes the strategy does not
        have or sizes whose product is not ``len(devices)``.

    Core's fallback puts every device on one axis named ``data``, or builds ``mesh_shape`` as
    given. Example, a strategy with a single ``fsdp`` axis::

        @hookimpl
        def make_mesh(self, devices, mesh_shape):
            return shardplug.core.mesh.build_mesh(devices, mesh_shape, default={"fsdp": -1})
    """


@hookspec(firstresult=True)
def shard_params(params: Any, mesh: Any, annotations: Any | None) -> Any:
    """Choose where every parameter lives.

    Called once at set-up, on abstract parameters: nothing has been allocated yet, and the
    parameters (and the optimizer state, which core shards like the parameter each leaf
    mirrors) are then created directly in the returned shardings.

    :param params: the model's trainable parameters as a pytree of ``jax.ShapeDtypeStruct``.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :param annotations: the model's own partition hints, a pytree of the same structure whose
        leaves are ``PartitionSpec`` of *logical* axis names (``P("embed", "mlp")``; ``P()`` for
        a parameter without a hint), or None when the model carries no hints at all.
    :return: a pytree of the same structure as ``params`` holding a ``PartitionSpec`` (or a
        ``NamedSharding`` on ``mesh``) for every leaf.

    Core's fallback replicates everything. Example, shard every matrix's first dimension::

        @hookimpl
        def shard_params(self, params, mesh):
            return jax.tree.map(lambda p: P("fsdp") if p.ndim == 2 else P(), params)
    """


@hookspec(firstresult=True)
def shard_batch(batch: Any, mesh: Any) -> Any:
    """Choose how every leaf of the global batch is split over the mesh.

    Called once, on the first batch (as ``jax.ShapeDtypeStruct``); later batches must have the
    same structure and shapes.

    :param batch: the global batch as a pytree of ``jax.ShapeDtypeStruct``.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :return: a pytree of the same structure holding a ``PartitionSpec`` (or ``NamedSharding``)
        for every leaf. Core checks that every split dimension divides its mesh axes and
        raises :class:`shardplug.errors.BatchError` naming the leaf when it does not.

    Core's fallback splits the leading (batch) dimension over every mesh axis. Example, split
    over ``data`` only and keep the ``model`` axis whole::

        @hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda _: P("data"), batch)
    """


@hookspec(firstresult=True)
def gather_params(params: Any, mesh: Any) -> Any:
    """Lay out the parameters for the forward and backward computation.

    Called while tracing the training step, on the parameters being differentiated, before
    the model is bound; the gradient flows back through whatever this returns. Core's
    fallback returns the parameters as they are stored and lets the compiler choose where
    the computation happens, which suits replicated and tensor-parallel layouts.

    :param params: the parameters, a pytree of traced arrays in their stored shardings.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :return: the parameters as the model should see them.

    Example, ZeRO-3: all-gather every parameter where it is used, so the compiler splits
    the batch rather than the weights' contractions, and reduce-scatters the gradient::

        @hookimpl
        def gather_params(self, params, mesh):
            whole = NamedSharding(mesh, P())
            return jax.tree.map(lambda p: jax.lax.with_sharding_constraint(p, whole), params)
    """


@hookspec(firstresult=True)
def reduce_grads(grads: Any, mesh: Any) -> Any:
    """Bring the gradients into the form the optimizer update expects.

    Called while tracing the training step, right after ``jax.value_and_grad``, so it may use
    collectives. Under ``jax.jit`` the gradients are already those of the global loss (the
    compiler inserts the all-reduce or reduce-scatter, or core sums the devices' gradients
    explicitly when :func:`encode_grads` is implemented), and core's fallback returns them
    unchanged. Inside an explicit per-device program each device holds the gradient of its
    own shard of the batch (encoded by :func:`encode_grads`, when implemented, and cast back
    to the parameters' dtypes afterwards), and the strategy averages them.

    :param grads: the gradients, a pytree shaped like the parameters.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :return: the gradients the optimizer should apply.

    Example, the per-device program's mean over the data axis::

        @hookimpl
        def reduce_grads(self, grads):
            return jax.lax.pmean(grads, "data")
    """


@hookspec(firstresult=True)
def encode_grads(grads: Any, mesh: Any) -> Any:
    """Choose what the gradients travel as between devices (for example bfloat16).

    Leave it unimplemented and the gradients are reduced as they are, wherever the compiler
    puts the reduction. Once any plugin implements it, the reduction becomes explicit: each
    device's gradient (that of its own rows of the batch) is computed, passed through this
    hook, summed across the batch's mesh axes in the dtype this hook returns, averaged, and
    cast back to each parameter's dtype before :func:`reduce_grads` and the optimizer see it.
    The loss, metrics and batch statistics are still those of the global batch (models that
    use :func:`shardplug.batch_axis_name` see it set while their gradient is computed).

    :param grads: one device's gradients, a pytree shaped like the parameters.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :return: a pytree of the same structure and shapes; the dtypes may change.

    Core's fallback returns the gradients unchanged. Add-ons implement it as a pluggy wrapper,
    so that they compose with the strategy's own answer. Example, the built-in ``grad-bf16``::

        @hookimpl(wrapper=True)
        def encode_grads(self, grads):
            encoded = yield
            return jax.tree.map(lambda g: g.astype(jnp.bfloat16), encoded)
    """


@hookspec(firstresult=True)
def compile_step(
    step_fn: Callable[[Any, Any], tuple[Any, dict[str, Any]]],
    mesh: Any,
    state_shardings: Any,
    batch_shardings: Any,
) -> Callable[[Any, Any], tuple[Any, dict[str, Any]]]:
    """Turn the training step into the program that runs on the devices.

    Called once at set-up, after the shardings are known; the trainer compiles what it gets
    for the first batch and reuses it for every step.

    :param step_fn: ``step_fn(state, batch) -> (state, metrics)``, one optimizer step written
        for the global batch. It calls :func:`reduce_grads` inside.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :param state_shardings: a ``NamedSharding`` for every leaf of the training state.
    :param batch_shardings: a ``NamedSharding`` for every leaf of the batch.
    :return: a callable with ``step_fn``'s signature that the trainer can ``.lower()`` (a
        ``jax.jit`` object). It must keep the state in ``state_shardings``, return scalar
        metrics that are the same on every device, and should donate the old state.

    Core's fallback is ``jax.jit`` with these in- and out-shardings and the state donated.
    Example, an explicit per-device program::

        @hookimpl
        def compile_step(self, step_fn, mesh, state_shardings, batch_shardings):
            def per_device(state, batch):
                state, metrics = step_fn(state, batch)
                return state, jax.lax.pmean(metrics, "data")

            specs = lambda tree: jax.tree.map(lambda s: s.spec, tree)
            per_device = jax.shard_map(
                per_device, mesh=mesh, check_vma=False,
                in_specs=(specs(state_shardings), specs(batch_shardings)),
                out_specs=(specs(state_shardings), P()),
            )
            return jax.jit(per_device, donate_argnums=0)
    """
