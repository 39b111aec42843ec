"""The hook specifications: the whole contract between the trainer and a plugin.

The trainer owns the loop. A plugin decides only where arrays live and how devices meet,
by implementing some of the hooks below. Each hook is called with keyword arguments and is
``firstresult``: the plugin's implementation wins, and core's fallback (in
:mod:`shardplug.core.fallbacks`) answers whatever it leaves out. An implementation may accept
fewer arguments than the spec names, as pluggy allows.

A plugin is an ordinary Python object whose methods carry ``@shardplug.plugin.hookimpl``,
published under the entry-point group ``shardplug``; the entry point's name is its name. If
the object is a class, ``get_strategy(name, **options)`` instantiates it with the options as
keyword arguments. There are two kinds:

- a **parallelism** implements :func:`parallel_axis` and, as it needs, the other hooks of
  :mod:`shardplug.core.parallel_hooks` (where its parameters and batch split, how a
  parameter is used, the operations it computes its own way, its account for explain): it
  owns one mesh axis, and core composes any number of them on one mesh by name
  (``"a+b+c"``, :mod:`shardplug.core.compose`). It may also implement the step hooks below
  (:func:`compute_grads`, :func:`reduce_grads`, :func:`encode_grads`, :func:`compile_step`,
  :func:`shard_model_state`); two parallelisms of one composition that implement the same
  step hook, or supply the same operation, are refused.
- a **whole strategy** implements the mesh and placement hooks itself (:func:`make_mesh`,
  :func:`shard_params`, :func:`shard_batch`, ...): it runs alone, as a per-device program
  and strategies written before compositions existed do.

**Mesh modes.** A run's mesh has ``Auto`` axes (the default) or ``Explicit`` ones (a model
written in JAX's explicit sharding mode; ``Trainer(axis_types=...)``). A plugin may assume:

- :func:`make_mesh` builds its mesh as always (``build_mesh`` makes ``Auto`` axes); core
  retypes it. Every PartitionSpec a hook returns means the same in both modes.
- Hooks that run inside the traced step (:func:`gather_params`, :func:`reduce_grads`,
  :func:`encode_grads`, :func:`compute_grads`, the operations of :func:`operations`, the
  function :func:`compile_step` wraps) see the current mode in ``jax.sharding.get_abstract_mesh()``
  and in each array's type (``jax.typeof(x).sharding``). There
  ``jax.lax.with_sharding_constraint``, looked up as ``jax.lax.with_sharding_constraint``,
  lays arrays out in both modes (on explicit axes core makes it ``jax.sharding.reshard``,
  where JAX's would only assert); ``shardplug.plugin.lay_out(x, spec)`` says so directly.
- On explicit axes the model's own placement wins: a parameter dimension its annotation
  places on a run's mesh axis is stored and used as it says (:func:`split_param` sees it
  in ``taken``, and is not asked for that parameter when its axis is one the model uses
  there; :func:`gather_param` cannot move it). Refused in one line: a mesh axis that does
  not divide that dimension, an axis the model's code names that the mesh lacks.
- A plugin that cannot run on explicit axes declares ``unsupported = {"explicit-axes":
  reason}`` and is refused there with the reason (a per-device program has no explicit
  axes). The conformance suite runs every other plugin in both modes, except a whole
  strategy whose parameters a model's explicit types cannot name: there core does what the
  compiler does on auto axes (a layer stack split along its layers is gathered a layer at a
  time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy

PROJECT = "shardplug"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Besides its hooks, a plugin may declare three fields (description, unsupported, baseline):
# core/declared.py says what each means and checks them.


@hookspec(firstresult=True)
def make_mesh(devices: Sequence[Any], mesh_shape: dict[str, int] | None) -> Any:
    """Arrange the devices into the mesh this strategy wants.

    Called once at set-up, before any array is created.

    :param devices: the devices of the run, in order (``jax.devices()`` or the first D of them).
    :param mesh_shape: the axis sizes the user asked for (``--mesh data=2,model=4`` gives
        ``{"rows": 2, "tensor": 4}``), or None when they asked for nothing.
    :return: a ``jax.sharding.Mesh`` over exactly these devices. Raise
        :class:`shardplug.errors.MeshError` when ``mesh_shape`` names axes the strategy does not
        have or sizes whose product is not ``len(devices)``.

    Core's fallback puts every device on one axis (named data: the run is data parallel), or
    builds ``mesh_shape`` as given. Example, a strategy with a single ``shards`` axis::

        @hookimpl
        def make_mesh(self, devices, mesh_shape):
            return shardplug.plugin.build_mesh(devices, mesh_shape, default={"shards": -1})
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
            return jax.tree.map(lambda p: P("shards") if p.ndim == 2 else P(), params)
    """


@hookspec(firstresult=True)
def shard_batch(batch: Any, mesh: Any, sequences: tuple[int, ...] | None) -> Any:
    """Choose how every leaf of the global batch is split over the mesh.

    Called on abstract batches (``jax.ShapeDtypeStruct``) each time a program is built for a
    batch structure: once for training (later batches must look alike), again for
    evaluation batches and by ``explain``, ``bench`` and ``Trainer.lower``. Answer from the
    shapes (and ``sequences``) alone, the same way every time.

    :param batch: the global batch as a pytree of ``jax.ShapeDtypeStruct``.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :param sequences: the sequence lengths the model's :func:`shardplug.attention` read when
        the program was traced with the layout answered before (its queries' and keys'
        second dimension; empty when the model never called it), or None before a trace.
        Core asks again with them after tracing, and traces anew if the answer changed.
    :return: a pytree of the same structure holding a ``PartitionSpec`` (or ``NamedSharding``)
        for every leaf. Core checks that every split dimension divides its mesh axes and
        raises :class:`shardplug.errors.BatchError` naming the leaf when it does not.

    Core's fallback splits the leading (batch) dimension over every mesh axis. Example, split
    over ``rows`` only and keep the ``tensor`` axis whole::

        @hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda _: P("rows"), batch)
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
            return jax.lax.pmean(grads, "rows")
    """


@hookspec(firstresult=True)
def encode_grads(grads: Any, mesh: Any) -> Any:
    """Choose what the gradients travel as between devices (for example bfloat16).

    Leave it unimplemented and the gradients are reduced as they are, wherever the compiler
    puts the reduction. Once any plugin implements it, the reduction becomes explicit: each
    device's gradient (that of its own rows of the batch) is computed, passed through this
    hook, summed across the batch's mesh axes in the dtype this hook returns and averaged,
    passed to :func:`reduce_grads` (still in that dtype), and then cast back to each
    parameter's dtype before the optimizer sees it.
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

    Called each time a program is built (the training step once per trainer for ``fit``,
    again by ``lower``, ``explain`` and ``bench``; the evaluation step once, on the first
    evaluation batch), after the shardings are known. The trainer wraps what it gets in its
    own ``jax.jit`` over the state's flat list of arrays, lowers and compiles that for the
    first batch, and reuses it for every step.

    :param step_fn: ``step_fn(state, batch) -> (state, metrics)``, one optimizer step written
        for the global batch. It calls :func:`reduce_grads` inside.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :param state_shardings: a ``NamedSharding`` for every leaf of the training state.
    :param batch_shardings: a ``NamedSharding`` for every leaf of the batch.
    :return: a callable with ``step_fn``'s signature that has ``.lower`` (a ``jax.jit``
        object; the trainer checks that and calls it inside its own ``jax.jit``). It must
        keep the state in ``state_shardings``, return scalar metrics that are the same on
        every device, and should donate the old state.

    Core's fallback is ``jax.jit`` with these in- and out-shardings and the state donated.
    Example, an explicit per-device program::

        @hookimpl
        def compile_step(self, step_fn, mesh, state_shardings, batch_shardings):
            def per_device(state, batch):
                state, metrics = step_fn(state, batch)
                return state, jax.lax.pmean(metrics, "rows")

            specs = lambda tree: jax.tree.map(lambda s: s.spec, tree)
            per_device = jax.shard_map(
                per_device, mesh=mesh, check_vma=False,
                in_specs=(specs(state_shardings), specs(batch_shardings)),
                out_specs=(specs(state_shardings), P()),
            )
            return jax.jit(per_device, donate_argnums=0)
    """


@hookspec(firstresult=True)
def shard_model_state(model_state: Any, mesh: Any) -> Any:
    """Choose where the model's non-trainable state lives (batch statistics, caches).

    Called once at set-up, on abstract model state, like :func:`shard_params`.

    :param model_state: the model state as a pytree of ``jax.ShapeDtypeStruct`` (often empty).
    :param mesh: the run's mesh.
    :return: a ``PartitionSpec`` (or ``NamedSharding``) for every leaf.

    Core's fallback replicates it: batch statistics are small and every device reads them.
    Example, split a stacked state's leading (layer) dimension over ``stages``::

        @hookimpl
        def shard_model_state(self, model_state):
            return jax.tree.map(lambda x: P("stages") if x.ndim else P(), model_state)
    """


@hookspec(firstresult=True)
def compute_grads(
    loss_and_grad: Callable[..., Any],
    params: Any,
    model_state: Any,
    batch: Any,
    rng: Any,
    mesh: Any,
    microbatches: int,
    prepare: Callable[..., Any],
    forward: Callable[..., Any],
    param_shardings: Any,
) -> Any:
    """Own the gradient computation of one step: forward and backward over its microbatches.

    Called while tracing the training step. Leave it unimplemented (return None) and core
    does it: the whole batch at once, or ``microbatches`` slices in a ``lax.scan`` with the
    gradients summed (``grad_accum``), and the explicit per-shard reduction when a plugin
    implements :func:`encode_grads`. A strategy that schedules the whole model's microbatches
    itself implements it (a pipeline of a layer stack need not: it supplies the layer stack's
    operation and runs inside the forward pass, :func:`operations`).

    :param loss_and_grad: ``loss_and_grad(params, model_state, batch, rng)`` returns
        ``((loss, (metrics, model_state)), grads)`` for one (micro)batch: core's forward
        (precision, :func:`gather_params`, the model bound, the user's loss) and its
        gradient with respect to ``params``.
    :param params: the parameters, in their stored shardings.
    :param model_state: the model's state before the step.
    :param batch: the step's global batch.
    :param rng: the step's key; fold in the microbatch index for each microbatch.
    :param mesh: the run's mesh.
    :param microbatches: how many microbatches the user asked for (``grad_accum``).
    :param prepare: ``prepare(params)``: the parameters as the step uses them (cast to the
        compute precision, gathered where a parallelism stores them split); under ``jax.jit``.
    :param forward: ``forward(prepared, model_state, batch, rng)`` returns ``(loss,
        (metrics, model_state))``: the loss of the parameters ``prepare`` gave, which a
        plugin that writes the backward pass itself differentiates (a pipeline schedule's
        own, :mod:`shardplug.plugin.ticks`); the gradient with respect to the prepared parameters
        is the stored ones' (cast back).
    :param param_shardings: the parameters' stored shardings (NamedSharding), or None.
    :return: ``((loss, (metrics, model_state)), grads)`` for the whole batch: the mean loss
        and metrics, the model state after the step and the mean gradient; or None to leave
        the step to core.

    Example, microbatches one after another in a Python loop (core's scan does the same)::

        @hookimpl
        def compute_grads(self, loss_and_grad, params, model_state, batch, rng, microbatches):
            outs = [loss_and_grad(params, model_state, jax.tree.map(
                lambda x: x[i::microbatches], batch), jax.random.fold_in(rng, i))
                for i in range(microbatches)]
            return jax.tree.map(lambda *xs: sum(xs) / microbatches, *outs)
    """


# The hooks of a composable parallelism live in core/parallel_hooks.py; they are part of this
# contract (registered with it).
from shardplug.core.parallel_hooks import (  # noqa: E402
    check_layout,
    check_program,
    explain_step,
    gather_param,
    operations,
    parallel_axis,
    split_batch,
    split_param,
    trace_context,
)

__all__ = [
    "check_layout",
    "check_program",
    "compile_step",
    "compute_grads",
    "encode_grads",
    "explain_step",
    "gather_param",
    "gather_params",
    "hookimpl",
    "hookspec",
    "make_mesh",
    "operations",
    "parallel_axis",
    "reduce_grads",
    "shard_batch",
    "shard_model_state",
    "shard_params",
    "split_batch",
    "split_param",
    "trace_context",
]
