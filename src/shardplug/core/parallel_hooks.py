"""The hooks of a composable parallelism: part of the contract of :mod:`shardplug.core.hookspecs`.

Implementing :func:`parallel_axis` makes a plugin a parallelism. Core calls each parallelism
of a composition on its own, its axis under the name the run gives it, in the orders of
:func:`shardplug.core.compose.order` (ranks: mesh order outermost first, parameters claimed
innermost first):

- set-up: :func:`split_param` for every parameter (innermost first), :func:`check_layout`
  once the layouts are known; :func:`split_batch` for every batch leaf, each time a program
  is built for a batch structure;
- while a step is traced: :func:`gather_param` (mesh order), and the :func:`operations` it
  computes its own way (attention, a mixture of experts' product, a layer stack's loop);
- after compiling: :func:`check_program` (before it runs), and for ``explain``:
  :func:`explain_step`.

Every hook is optional but :func:`parallel_axis`; the fallbacks split nothing and keep every
layout as stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from shardplug.core.compose import Axis
    from shardplug.core.facts import Explained, StepFacts
    from shardplug.core.ops import Operations

hookspec = pluggy.HookspecMarker("shardplug")


@hookspec(firstresult=True)
def parallel_axis() -> Axis:
    """Declare the mesh axis this parallelism owns: implementing it makes a plugin composable.

    Called once when a composition is built.

    :return: a :class:`shardplug.plugin.Axis`: the axis's name (its role, which
        ``--axis-name`` may rename), its place in the order (``rank``; the built-ins' are
        :data:`shardplug.plugin.RANK`), whether the batch's rows split over it (``batch``),
        the logical activation names it splits (for :func:`shardplug.constrain`), and whether
        it lends its axis to store what it leaves whole (``lends``).

    Example, tensor parallelism::

        @hookimpl
        def parallel_axis(self):
            return Axis("tensor", rank=45, logical=("mlp", "heads"), lends=True)
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
def trace_context(axis: str, mesh: Any, replicas: tuple[str, ...], batch_axes: tuple) -> Any:
    """A context manager entered around the tracing of every program of the run.

    For what :func:`operations` does not say (a plugin written before it installed its
    operations this way, with ``shardplug.plugin.attention_override`` and the like).

    :param axis: this parallelism's mesh axis, as the run names it.
    :param mesh: the run's mesh.
    :param replicas: as for :func:`operations`.
    :param batch_axes: as for :func:`operations`.
    :return: a context manager, or None.

    Example, trace with JAX's debug NaN checks on (``jax.debug_nans``)::

        @hookimpl
        def trace_context(self):
            return jax.debug_nans(True)
    """


@hookspec(firstresult=True)
def explain_step(axis: str, mesh: Any, step: StepFacts) -> Explained | None:
    """Describe this parallelism's share of a compiled step, for ``shardplug explain``.

    Called by :func:`shardplug.explain.explain` after the step is compiled (its operations
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
