"""The hook specifications: the whole contract between the trainer and a plugin, in one
module, grouped by the phase of a run that calls them (as pytest's ``hookspec.py`` is).

The trainer owns the loop. A plugin decides only where arrays live and how devices meet,
by implementing some of the hooks below. Each hook is called with keyword arguments and is
``firstresult``: the plugin's implementation wins, and core's fallback (in
:mod:`shardplug.core.fallbacks`) answers whatever it leaves out. An implementation may accept
fewer arguments than the spec names, as pluggy allows.

A plugin is an ordinary Python object whose methods carry ``@shardplug.plugin.hookimpl``,
published under the entry-point group ``shardplug``; the entry point's name is its name. If
the object is a class, ``get_strategy(name, **options)`` instantiates it with the options as
keyword arguments. Besides its hooks it may declare four class attributes, and core reads no
other attribute of a plugin: ``description``, ``unsupported``, ``capabilities`` and
``baseline`` (:mod:`shardplug.core.declared` says what each means and checks them). There
are two kinds of plugin:

- a **parallelism** implements :func:`parallel_axis` (returning an :class:`Axis`) and, as it
  needs, the other hooks of a part: :func:`split_param`, :func:`check_layout`,
  :func:`split_batch`, :func:`gather_param`, :func:`operations`, :func:`check_program` and
  :func:`explain_step` (where its parameters and batch split, how a parameter is used, the
  operations it computes its own way, its account for explain). It owns one mesh axis, and
  core composes any number of them on one mesh by name (``"a+b+c"``,
  :mod:`shardplug.core.compose`), calling each on its own, its axis under the name the run
  gives it, in the orders of :func:`shardplug.core.compose.order` (ranks: mesh order
  outermost first, parameters claimed innermost first). Every hook of a part is optional
  but :func:`parallel_axis`; the fallbacks split nothing and keep every layout as stored.
  It may also implement the step hooks (:func:`compute_grads`, :func:`reduce_grads`,
  :func:`encode_grads`, :func:`compile_step`, :func:`shard_model_state`); two parallelisms
  of one composition that implement the same step hook, or supply the same operation, are
  refused.
- a **whole strategy** implements the mesh and placement hooks itself (:func:`make_mesh`,
  :func:`shard_params`, :func:`shard_batch`, ...): it runs alone, as a per-device program
  and strategies written before compositions existed do.

The sections below follow a run:

1. **Set-up**, on abstract arrays, before anything is allocated: the mesh
   (:func:`make_mesh`; a parallelism's :func:`parallel_axis`), where the parameters, the
   model state and the batch live (:func:`shard_params`, :func:`split_param` for every
   parameter, innermost first, :func:`check_layout` once the layouts are known,
   :func:`shard_model_state`, the memory each state array lives in (:func:`place_state`)
   and where the update computes then (:func:`update_memory`),
   :func:`shard_batch` and :func:`split_batch` for every batch leaf, again each time a
   program is built for a batch structure).
2. **Per-step tracing**, each time a program is built: the program (:func:`compile_step`),
   the parameters as the step uses them (:func:`gather_params`; :func:`gather_param` in
   mesh order), the operations a parallelism computes its own way (:func:`operations`:
   attention, a mixture of experts' product, a layer stack's loop) and the gradients
   (:func:`compute_grads`, :func:`encode_grads`, :func:`reduce_grads`).
3. **After compiling**, before the step first runs: :func:`check_program`.
4. **Explain**: :func:`explain_step`, a parallelism's account of the compiled step.

**Mesh modes.** A run's mesh has ``Auto`` axes (the default) or ``Explicit`` ones (a model
written in JAX's explicit sharding mode; ``Trainer(axis_types=...)``). A plugin may assume:

- :func:`make_mesh` builds its mesh as always (``build_mesh`` makes ``Auto`` axes); core
  retypes it. Every PartitionSpec a hook returns means the same in both modes.
- Hooks that run inside the traced step (:func:`gather_params`, :func:`reduce_grads`,
  :func:`encode_grads`, :func:`compute_grads`, the operations of :func:`operations`, the
  function :func:`compile_step` wraps) see the current mode in
  ``jax.sharding.get_abstract_mesh()`` and in each array's type
  (``jax.typeof(x).sharding``). There ``shardplug.plugin.lay_out(x, spec)`` lays arrays out
  in both modes (``jax.sharding.reshard`` on explicit axes, ``with_sharding_constraint`` on
  auto ones); JAX's ``jax.lax.with_sharding_constraint`` only asserts on explicit axes, and
  a hook that fails so is told to use ``lay_out``.
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

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from shardplug.core.compiled.facts import Explained, StepFacts
from shardplug.core.ops import Operations

PROJECT = "shardplug"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -------------------------------------------------------------------------------------------
# Set-up: the mesh, and where the parameters, the model state and the batch live; asked of
# abstract arrays (jax.ShapeDtypeStruct), so that nothing is allocated before it is placed.
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Axis:
    """The mesh axis a parallelism owns, as its :func:`parallel_axis` hook declares it.

    :param name: the axis's role and default name (``--axis-name ROLE=NAME`` renames it).
    :param rank: its place in the order: lower is further out in the mesh and claims
        parameter dimensions later (:data:`shardplug.plugin.RANK` gives the built-ins'; a
        new parallelism picks a number between them).
    :param batch: whether the batch's leading dimension (its rows) splits over this axis,
        the default of :func:`split_batch`.
    :param logical: logical activation names this axis splits (``shardplug.constrain``).
    :param lends: whether a parameter this parallelism leaves whole may be stored split over
        its axis by another (one that gathers it at use); replicas keep whole copies and do
        not lend.
    """

    name: str
    rank: int
    batch: bool = False
    logical: tuple[str, ...] = ()
    lends: bool = False


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

    Core's fallback puts every device on one axis (named data: the run is data parallel), or
    builds ``mesh_shape`` as given. Example, a strategy with a single ``shards`` axis::

        @hookimpl
        def make_mesh(self, devices, mesh_shape):
            return shardplug.plugin.build_mesh(devices, mesh_shape, default={"shards": -1})
    """


@hookspec(firstresult=True)
def parallel_axis() -> Axis:
    """Declare the mesh axis this parallelism owns: implementing it makes a plugin composable.

    Called once when a composition is built.

    :return: a :class:`shardplug.plugin.Axis`: the axis's name (its role, which
        ``--axis-name`` may rename), its place in the order (``rank``; the built-ins' are
        :data:`shardplug.plugin.RANK`), whether the batch's rows split over it (``batch``),
        the logical activation names it splits (for :func:`shardplug.constrain`), and whether
        it lends its axis to store what it leaves whole (``lends``).

    Example, tensor parallelism (``RANK`` from :mod:`shardplug.plugin`)::

        @hookimpl
        def parallel_axis(self):
            return Axis("model", rank=RANK["model"], logical=("mlp", "heads"), lends=True)
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
def split_param(
    shape: tuple[int, ...],
    logical: Any,
    axis: str,
    size: int,
    taken: frozenset[int],
    spare: dict[str, int],
) -> int | tuple[int, tuple[str, ...]] | None:
    """Which dimension of one parameter this parallelism splits over its axis, if any.

    Called once per parameter at set-up, parallelisms innermost first (tensor parallelism
    claims first, as in torchtitan): those called before have claimed the dimensions in
    ``taken`` (and, on explicit axes, so has a model that places a dimension itself).
    Returning a taken dimension is an error that names both.

    :param shape: the parameter's shape.
    :param logical: its logical ``PartitionSpec`` (``P("embed", "mlp")``; ``P()`` without one).
        A model that names mesh axes directly (Flax's explicit-sharding examples) names
        ``axis`` itself here.
    :param axis: this parallelism's mesh axis, as the run names it.
    :param size: that axis's size; the chosen dimension must be divisible by it.
    :param taken: dimensions already split.
    :param spare: the axes (and sizes) of parallelisms that split nothing of this parameter
        and lend their axis for storage (``Axis.lends``); a parallelism that gathers the
        parameter at use may store it split over them too.
    :return: a dimension index, or ``(dimension, borrowed spare axes)`` to split it over
        this axis and those, or None to leave the parameter whole along this axis.

    Core's fallback splits nothing. Example, the first free dimension that divides::

        @hookimpl
        def split_param(self, shape, size, taken):
            return next((d for d, n in enumerate(shape) if d not in taken and n % size == 0),
                        None)
    """


@hookspec(firstresult=True)
def check_layout(
    paths: list[str], specs: list[Any], axis: str, leaves: list[Any], logical: list[Any]
) -> None:
    """Refuse a model this parallelism cannot split, once every parameter's layout is known.

    Called once at set-up, after :func:`split_param` has run for every parameter.

    :param paths: every parameter's path (``blocks/wq``).
    :param specs: every parameter's stored ``PartitionSpec``, in the same order.
    :param axis: this parallelism's mesh axis, as the run names it.
    :param leaves: every parameter as a ``jax.ShapeDtypeStruct`` (its shape and dtype).
    :param logical: every parameter's logical ``PartitionSpec`` (``P()`` without one): what
        the model named its dimensions, to say which name was not taken.
    :return: None; raise a :class:`shardplug.errors.ConfigError` saying what to change.

    Example, pipeline stages need a layer stack::

        @hookimpl
        def check_layout(self, specs, axis):
            if not any(len(s) and s[0] == axis for s in specs):
                raise ConfigError("this model has no layer stack: build it with shardplug.stack")
    """


@hookspec(firstresult=True)
def shard_model_state(model_state: Any, mesh: Any) -> Any:
    """Choose where the model's non-trainable state lives (batch statistics, caches).

    Called once at set-up, on abstract model state, like :func:`shard_params`.

    :param model_state: the model state as a pytree of ``jax.ShapeDtypeStruct`` (often empty).
    :param mesh: the run's mesh.
    :return: a ``PartitionSpec`` (or ``NamedSharding``) for every leaf.

    Core's fallback replicates it: batch statistics are small and every device reads them.
    Example, split a stacked state's leading (layer) dimension over ``stage``::

        @hookimpl
        def shard_model_state(self, model_state):
            return jax.tree.map(lambda x: P("stage") if x.ndim else P(), model_state)
    """


@hookspec(firstresult=True)
def place_state(shardings: Any, state: Any, mesh: Any) -> Any:
    """Choose the memory each array of the training state lives in between steps: the
    devices' own (the default) or the host's (``"pinned_host"``: offload).

    Called once at set-up, after the parameters, optimizer state and model state are laid out
    (:func:`shard_params`, :func:`split_param`, :func:`shard_model_state`; the optimizer's
    state follows its parameter), so it composes with every parallelism's layout: it may
    change where an array lives, never how it is split.

    :param shardings: a ``shardplug.TrainState`` (``step``, ``params``, ``opt_state``,
        ``model_state``, ``rng``) of one ``NamedSharding`` per state array, in device memory.
    :param state: the same tree of ``jax.ShapeDtypeStruct``: each array's global shape and
        dtype (to choose by size).
    :param mesh: the run's mesh.
    :return: the same tree, each ``NamedSharding`` with the memory kind its array lives in
        (``sharding.with_memory_kind("pinned_host")``; the kinds a device has are
        ``device.addressable_memories()``), or None to keep every array on the devices.
        Refused in one line: another structure, another layout, a kind the devices lack.

    Core does the rest: the state is made and kept where the shardings say (the compiled
    step's arguments and results, checkpoints saved and restored there), and inside the
    step an array kept off the devices is brought to them where it is used (the
    parameters for the forward pass, the optimizer state for the update) and its new value
    sent back; explain counts host memory apart from device memory. A per-device program
    (``pmap``) cannot take arrays off the devices and refuses it. Example, the optimizer
    state in host memory::

        @hookimpl
        def place_state(self, shardings):
            host = lambda s: s.with_memory_kind("pinned_host")
            return shardings._replace(opt_state=jax.tree.map(host, shardings.opt_state))
    """


@hookspec(firstresult=True)
def update_memory(mesh: Any) -> str | None:
    """Where the optimizer's update computes when :func:`place_state` keeps the optimizer
    state in host memory.

    :param mesh: the run's mesh.
    :return: ``"device"`` (the default, as None): the state is copied to the devices for the
        update, after the backward pass, and back, one parameter's at a time where the
        update provably treats each parameter alone (else whole); or ``"host"``: the update
        runs in host memory, next to the state (ZeRO-Offload's): each step's gradients are
        copied to the host and the new parameters back, and the optimizer state never
        reaches the devices. Refused in one
        line: another value, or ``"host"`` with the optimizer state on the devices.
    """


@hookspec
def held_weights(params: Any, mesh: Any, roles: Any) -> list[Any] | None:
    """Which weights an add-on runs the products of its own way (float8's), asked while
    tracing the training step's forward pass.

    Each weight named is *held*: marked where the model reads it (a layer stack's a layer at
    a time, inside its loop), and the step's forward pass is rewritten so that each
    ``dot_general`` by it runs the rule registered for its :class:`shardplug.plugin.Hold`'s
    ``kind`` (``shardplug.core.operations.held.RULES``); anything else reads the weight as it is
    (said
    once). Evaluation, checkpoints and the stored parameters are unchanged.

    :param params: the parameters as the step's forward pass reads them (gathered, cast).
    :param mesh: the run's mesh.
    :param roles: what each parameter does in the step, by its path: a
        :class:`shardplug.plugin.Role` (``kind``: ``"linear"``, ``"head"``, ``"embedding"``,
        ``"router"``, ``"grouped"``, ``"convolution"`` or ``"elementwise"``, and why), read
        from the model's traced loss; None where the model does not trace alone (its code
        names a per-device program's axes) and for a model whose adapters multiply beside
        their weights (LoRA's). Choose default targets by it, not by names (float8's: the
        ``"linear"`` ones).
    :return: one ``Hold`` or None per leaf of ``params`` (``jax.tree.leaves`` order), or
        None: no weight is held (the default). Unlike the other hooks, every plugin's
        answer counts (two add-ons may hold different weights); two holding one weight are
        refused in one line.

    Example, every linear layer's products in a kind of one's own::

        @hookimpl
        def held_weights(self, params, roles):
            return [Hold(path, "mine") if roles and roles[path].kind == "linear" else None
                    for path in leaf_paths(params)]
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
    over ``data`` only and keep the ``model`` axis whole::

        @hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda _: P("data"), batch)
    """


@hookspec(firstresult=True)
def split_batch(
    path: str, shape: tuple[int, ...], axis: str, size: int, sequence: bool | None
) -> int | None:
    """Which dimension of one batch leaf this parallelism splits over its axis, if any: the
    batch constraint of the part that needs it.

    Called for every batch leaf each time a program is built for a batch structure
    (abstract shapes: answer from them alone), parallelisms in mesh order; a dimension
    several split is split over their axes in that order. Core checks that the axes divide
    the dimension (a :class:`shardplug.errors.BatchError` naming the leaf).

    :param path: the leaf's path in the batch (``tokens``).
    :param shape: its global shape.
    :param axis: this parallelism's mesh axis, as the run names it.
    :param size: that axis's size.
    :param sequence: whether the leaf's second dimension is a sequence, as far as core
        knows: True where the model's :func:`shardplug.attention` read a sequence of that
        length (or one shorter: tokens fed as ``tokens[:, :-1]``) or the leaf holds integers
        (token ids); False for a leaf of fewer than two dimensions, and, once the program
        was traced, for the rest; None for floats before the first trace (core asks again
        after it, and traces anew if the answer changed).
    :return: a dimension index, or None to keep the leaf whole along this axis. Raise
        :class:`shardplug.errors.ConfigError` for a leaf this parallelism cannot take.

    Without it a parallelism splits each leaf's leading dimension (its rows) where its
    ``Axis`` says ``batch``, and nothing otherwise. A parallelism that splits a sequence
    and declares ``without-sequence`` unsupported is refused in one line when it splits no
    leaf of a traced batch. Example, the sequence (dimension 1), placed whole where the
    devices do not divide it::

        @hookimpl
        def split_batch(self, shape, size, sequence):
            if sequence is False:
                return None
            return None if shape[1] % size else 1
    """


# -------------------------------------------------------------------------------------------
# Per-step tracing: the step's program, built each time a program is traced (training,
# evaluation, explain, bench); these hooks run inside the trace.
# -------------------------------------------------------------------------------------------


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
        for the global batch (``state`` a ``shardplug.TrainState``: ``step``, ``params``,
        ``opt_state``, ``model_state``, ``rng``). It calls :func:`reduce_grads` inside, and
        brings arrays kept in host memory (:func:`place_state`) to the devices itself.
    :param mesh: the mesh returned by :func:`make_mesh`.
    :param state_shardings: a ``TrainState`` of one ``NamedSharding`` per state array, each
        with the memory kind its array lives in between steps (``device`` unless
        :func:`place_state` chose the host's): keep them as they are in the program's in- and
        out-shardings, or the state moves.
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
                return state, jax.lax.pmean(metrics, "data")

            specs = lambda tree: jax.tree.map(lambda s: s.spec, tree)
            per_device = jax.shard_map(
                per_device, mesh=mesh, check_vma=False,
                in_specs=(specs(state_shardings), specs(batch_shardings)),
                out_specs=(specs(state_shardings), P()),
            )
            return jax.jit(per_device, donate_argnums=0)
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
            return jax.tree.map(lambda p: lay_out(p, whole), params)
    """


@hookspec(firstresult=True)
def gather_param(spec: Any, axis: str) -> Any:
    """The layout one parameter has where the forward pass uses it, given its stored layout.

    Called while tracing the step, once per parameter, parallelisms in mesh order (outermost
    first), each seeing the previous one's answer. Core constrains the parameter to the final
    spec when it differs from the stored one (the gradient flows back through it); a layer
    stack's parameters are gathered one layer at a time, inside its loop.

    :param spec: the parameter's ``PartitionSpec`` so far.
    :param axis: this parallelism's mesh axis, as the run names it.
    :return: a ``PartitionSpec``.

    Core's fallback keeps the spec. Example, ZeRO-3: gather the dimension it split (over its
    axis and any it borrowed), so the other parallelisms' splits stay::

        @hookimpl
        def gather_param(self, spec, axis):
            mine = lambda e: e == axis or (isinstance(e, tuple) and axis in e)
            return P(*(None if mine(entry) else entry for entry in spec))
    """


@hookspec(firstresult=True)
def operations(
    axis: str, mesh: Any, replicas: tuple[str, ...], batch_axes: tuple[str, ...]
) -> Operations | None:
    """The operations this parallelism computes its own way while the step is traced.

    Called each time a program of the run is traced (training, evaluation, explain); core
    installs what it returns around the tracing. A model calls :func:`shardplug.attention`,
    :func:`shardplug.moe.routed_experts` and :mod:`shardplug.stack`, and whichever of them a
    parallelism supplies runs its way: the model's code does not change between strategies.
    Two parallelisms of one composition that supply the same operation are refused.

    :param axis: this parallelism's mesh axis, as the run names it.
    :param mesh: the run's mesh.
    :param replicas: the batch axes over which no parameter is split: a per-device program
        may take them as manual axes, each device's rows its own.
    :param batch_axes: every axis the batch's rows split over, in mesh order.
    :return: a :class:`shardplug.plugin.Operations` (each field a function with the
        signature its protocol in :mod:`shardplug.core.ops` gives; ``unused`` is told which
        of them a traced program never called), or None.

    Example, attention over a sequence split on the axis, its keys and values gathered::

        @hookimpl
        def operations(self, axis, mesh):
            def attend(query, key, value, *, causal, bias, mask, scale):
                whole = P(None, None, P.UNCONSTRAINED, P.UNCONSTRAINED)
                key, value = lay_out(key, whole), lay_out(value, whole)
                out = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                                   scale=scale, is_causal=causal)
                return lay_out(out, P(None, axis))

            return Operations(attention=attend)
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
        own tick loop); the gradient with respect to the prepared parameters
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


# -------------------------------------------------------------------------------------------
# After compiling: before the compiled training step first runs.
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def check_program(axis: str, mesh: Any, hlo: str) -> None:
    """Refuse, in one line, a compiled training step this parallelism cannot run.

    Called once each training step is compiled, before it first runs, with the optimised
    program's text (``compiled.as_text()``; asked only of parallelisms that implement this
    hook). Raise :class:`shardplug.plugin.ConfigError` saying what to change; return None to
    let it run; or, having changed what it will trace, raise
    :class:`shardplug.plugin.TraceAgain` and core traces and compiles the step once more.

    :param axis: this parallelism's mesh axis, as the run names it.
    :param mesh: the run's mesh.
    :param hlo: the compiled program's HLO text.

    Example, a pipeline whose stages each choose their own pass: a collective-permute inside
    that choice (the other stages never reach it; it would wait forever)::

        @hookimpl
        def check_program(self, axis, hlo):
            if any("collective-permute(" in line and "stage_pass/" in line
                   for line in hlo.splitlines()):
                raise ConfigError("...: use a schedule that runs one pass on every stage")
    """


# -------------------------------------------------------------------------------------------
# Explain: a parallelism's account of the compiled step, for ``shardplug explain``.
# -------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def explain_step(axis: str, mesh: Any, step: StepFacts) -> Explained | None:
    """Describe this parallelism's share of a compiled step, for ``shardplug explain``.

    Called by :func:`shardplug.planning.explain.explain` after the step is compiled (its operations
    traced), once per parallelism of the composition.

    :param axis: this parallelism's mesh axis, as the run names it.
    :param mesh: the run's mesh.
    :param step: what explain read off the compiled step (:class:`shardplug.plugin.StepFacts`).
    :return: a :class:`shardplug.plugin.Explained` (a named report for the JSON and notes for
        the printed page), or None to add nothing.

    Example, the bytes of the step's collective-permutes as a note::

        @hookimpl
        def explain_step(self, axis, step):
            sent = sum(c["bytes"] for c in step.collectives if c["kind"] == "collective-permute")
            return Explained(notes=(f"{axis}: {sent} B of collective-permutes a step",))
    """


__all__ = [
    "Axis",
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
]
