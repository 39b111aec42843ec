"""A step lowered and compiled into a :class:`Program`, and the state it runs on, as values.

The trainer builds them; the loop (:mod:`shardplug.loop.run`) and evaluation
(:mod:`shardplug.loop.evaluate`) take them and return new state, and neither reaches into
the trainer. A program takes and returns the training state as its flat list of arrays
(PRNG keys as their key data): rebuilding the state's pytree on the host for every step
cost more than a small model's whole step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from shardplug.core import cache, memory, ops
from shardplug.core.compose import implemented
from shardplug.core.flops import forward_flops
from shardplug.core.means import divides_by_data
from shardplug.core.operations import attention
from shardplug.core.operations.roles import Roles, roles_in
from shardplug.core.sharding import leaf_paths
from shardplug.core.step import (
    key_impl,
    make_eval_step,
    make_step,
    trace_loss,
    unwrap_keys,
    wrap_keys,
)
from shardplug.errors import ConfigError, PluginError, ShardplugError, TraceAgain, unsay
from shardplug.loop import feed


class Program(NamedTuple):
    """A compiled step and the batches it was compiled for."""

    compiled: Any  # jax.stages.Compiled: (leaves, batch) -> (leaves, metrics)
    batch_shardings: Any
    signature: Any  # the batches' structure, shapes and dtypes (loop.feed.signature)
    jaxpr: Any  # the traced step, for its FLOP count (shardplug.core.flops.step_flops)
    model_flops: float | None = None  # the model's per step, the same under every strategy


@dataclasses.dataclass
class RunState:
    """The training state as programs take it, and where the run stands.

    The loop and evaluation replace ``leaves`` with what each donating program returns.
    """

    leaves: list[Any]  # the TrainState's leaves, PRNG keys as key data
    treedef: Any  # the TrainState's tree structure
    key_impls: list[Any]  # each leaf's PRNG implementation (None for other arrays)
    step: int = 0  # steps taken, counting a restored checkpoint's: the data position
    saved_step: int | None = None  # the step of the newest checkpoint saved or restored
    facts: tuple[Any, Any] | None = None  # (program, its StepFacts), read once per program
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)  # every row
    skipped: int = 0  # steps skipped for a non-finite loss or gradient

    @classmethod
    def of(cls, state: Any, like: RunState | None = None) -> RunState:
        """``state`` (a TrainState) as flat leaves; where ``like`` stands (its step, last
        checkpoint, history and skipped steps)."""
        leaves, treedef = jax.tree.flatten(state)
        impls = [key_impl(x) for x in leaves]
        run = cls(unwrap_keys(leaves, impls), treedef, impls)
        if like is not None:
            run.step, run.saved_step = like.step, like.saved_step
            run.history, run.skipped = like.history, like.skipped
        return run

    def resumed(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Stand where a restored checkpoint's JSON ``meta`` says the run stood; ``meta``."""
        self.step, self.saved_step = int(meta["data_position"]), int(meta["step"])
        self.skipped = int(meta.get("skipped_steps", 0))
        return meta

    def state(self) -> Any:
        """The TrainState, rebuilt from the leaves."""
        return jax.tree.unflatten(self.treedef, wrap_keys(self.leaves, self.key_impls))


def tracing(mesh: Any, strategy: Any) -> contextlib.ExitStack:
    """Where every program of a run is traced: under its mesh (so PartitionSpecs in a
    model's forward pass resolve) and the strategy's contexts (activation rules, pipelines)."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(jax.set_mesh(mesh))
        for context in strategy.contexts_while_tracing(mesh):
            stack.enter_context(context)
    except BaseException:  # a context that refuses leaves none of those before it entered
        stack.close()
        raise
    return stack


def lower(
    step_for: Callable[[Any], Callable],
    batch: Any,
    *,
    strategy: Any,
    mesh: Any,
    state_shardings: Any,
    run: RunState,
    microbatches: int = 1,
) -> tuple[Any, Any, Any]:
    """Shard ``batch`` as the strategy says and lower ``step_for(its shardings)`` over the
    flat state; the batch must cut into ``microbatches`` that each split like it.

    :return: the ``jax.stages.Lowered`` program, the batch shardings and the traced jaxpr.
    """
    abstract = jax.tree.map(feed.global_struct, batch)
    # what tracing warns is said once the layout is settled (a refusal comes alone)
    with warnings.catch_warnings(record=True) as said:
        try:
            traced, batch_shardings = _settle(step_for, abstract, strategy=strategy, mesh=mesh,
                                              state_shardings=state_shardings, run=run,
                                              microbatches=microbatches)  # fmt: skip
        except BaseException:
            unsay(str(w.message) for w in said)  # to be said by a program that gets built
            raise
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    lowered, jaxpr = traced
    return lowered, batch_shardings, jaxpr


def _settle(step_for, abstract, *, strategy, mesh, **context):
    """The step traced with the batch laid out as the strategy says, given the sequence
    lengths the model's attention reads: traced with the layout guessed from the shapes,
    and again only where knowing them changes it."""
    batch_shardings = strategy.shard_batch(abstract, mesh, None)
    traced, seen = _trace(step_for, abstract, batch_shardings, strategy=strategy, mesh=mesh,
                          **context)  # fmt: skip
    settled = strategy.shard_batch(abstract, mesh, tuple(sorted(seen)))
    if jax.tree.leaves(settled) != jax.tree.leaves(batch_shardings):
        batch_shardings = settled
        traced, _ = _trace(step_for, abstract, batch_shardings, strategy=strategy, mesh=mesh,
                           **context)  # fmt: skip
    return traced, batch_shardings


def _trace(step_for, abstract, batch_shardings, *, strategy, mesh, state_shardings, run,
           microbatches):  # fmt: skip
    """The flat step traced and lowered for ``batch_shardings`` (and its jaxpr), and the
    sequence lengths its attention read."""
    if jax.process_count() > 1:
        jax.tree.map(feed.check_process_rows, abstract, batch_shardings)
    if microbatches > 1:
        check = functools.partial(feed.check_microbatches, microbatches)
        jax.tree.map(check, abstract, batch_shardings)
    program = strategy.compile_step(step_for(batch_shardings), mesh, state_shardings,
                                    batch_shardings)  # fmt: skip
    if not hasattr(program, "lower"):
        raise PluginError(
            f"strategy {strategy.name!r}: compile_step must return a jax.jit object "
            f"(something with .lower), got {type(program).__name__}"
        )

    def with_sharding(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    treedef, impls = run.treedef, run.key_impls
    flat_shardings = jax.tree.leaves(state_shardings)

    def flat(leaves, batch):
        state, metrics = program(jax.tree.unflatten(treedef, wrap_keys(leaves, impls)), batch)
        return unwrap_keys(jax.tree.leaves(state), impls), metrics

    flat = jax.jit(
        flat,
        in_shardings=(flat_shardings, batch_shardings),
        out_shardings=(flat_shardings, None),
        donate_argnums=0,
    )
    with tracing(mesh, strategy), ops.reading_lengths() as seen, _cpu_float16():
        traced = flat.trace(
            list(map(with_sharding, run.leaves, flat_shardings)),
            jax.tree.map(with_sharding, abstract, batch_shardings),
        )
        paths = leaf_paths(jax.tree.unflatten(treedef, flat_shardings))
        memory.check_program(traced.jaxpr, flat_shardings, len(jax.tree.leaves(abstract)),
                             f"strategy {strategy.name!r}", paths)  # fmt: skip
        return (traced.lower(), traced.jaxpr), seen


@contextlib.contextmanager
def _cpu_float16() -> Any:
    """XLA:CPU's refusal of a float16 matrix product, in one line (not 392 of XLA's)."""
    try:
        yield
    except ValueError as exc:
        if "is not supported by dot_general on CPU" not in str(exc):
            raise
        raise ConfigError(
            f"{str(exc).splitlines()[0]}: XLA:CPU has no float16 matrix product; train "
            "float16 parameters on a GPU, or cast them (--param-dtype bfloat16 or float32)"
        ) from None


def build(step_for: Callable[[Any], Callable], batch: Any, **context: Any) -> Program:
    """:func:`lower`, compiled: the program for batches shaped like ``batch``."""
    device = context["mesh"].devices.flat[0]
    refused = contextlib.ExitStack()  # a fused kernel that failed, refused in every retrace
    with refused:
        lowered, batch_shardings, jaxpr = lower(step_for, batch, **context)
        try:
            compiled = cache.compile_step(lowered, jaxpr, device)
        except Exception as exc:  # a fused attention kernel cannot compile so: XLA's, said
            failed = attention.partitioner_failed(exc)
            if failed is None:
                raise
            refused.enter_context(attention.refusing(*failed))
            lowered, batch_shardings, jaxpr = lower(step_for, batch, **context)
            try:
                compiled = cache.compile_step(lowered, jaxpr, device)
            except Exception as again:
                raise again from exc
        try:
            _checked(compiled, context["strategy"], context["mesh"])
        except TraceAgain:  # a parallelism changed what it traces: once more, and final
            lowered, batch_shardings, jaxpr = lower(step_for, batch, **context)
            compiled = cache.compile_step(lowered, jaxpr, device)
            _checked(compiled, context["strategy"], context["mesh"])
    return Program(compiled, batch_shardings, feed.signature(batch), jaxpr)


def _checked(compiled: Any, strategy: Any, mesh: Any) -> None:
    """The parallelisms that check a compiled program (``check_program``) shown it."""
    parts = strategy.composition.parts if strategy.composition is not None else []
    asked = [p for p in parts if "check_program" in implemented(p.plugin)]
    if asked:
        text = compiled.as_text()
        for part in asked:
            part.call("check_program", axis=part.axis.name, mesh=mesh, hlo=text)


def place(program: Program, batch: Any, index: int) -> Any:
    """Check a training batch against the program's; in many processes, assemble the global
    batch from this process's rows. One process hands its host arrays to the compiled step,
    whose C++ dispatch copies them into the batch shardings (``jax.device_put`` in Python
    cost several times a small model's step)."""
    feed.check(batch, index, program.signature)
    if jax.process_count() == 1:
        return batch
    return feed.put(batch, program.batch_shardings)


def loss_facts(adapter: Any, loss_fn: Any, batch: Any, mesh: Any) -> tuple[bool, Any, Any]:
    """What the model's loss on ``batch``, traced alone (:func:`trace_loss`, once per
    compiled step), says: whether it divides by a count taken from the batch, its forward
    FLOPs, and each parameter's role (:class:`~shardplug.core.operations.roles.Roles`, read
    when asked); ``(False, None, None)`` for a model that traces only inside a strategy's
    program (one that reads a per-device program's axis), whose rows then count the
    step's FLOPs."""
    # the model alone, in float32: what it warns (its attention's kernel) is not the run's
    with warnings.catch_warnings(record=True) as said:
        try:
            traced = trace_loss(adapter, loss_fn, batch, mesh)
        except (NameError, ValueError, TypeError, ShardplugError):
            traced = None
    unsay(str(w.message) for w in said)  # the step's own trace says what applies to it
    if traced is None:
        return False, None, None
    roles = Roles(lambda: roles_in(traced, leaf_paths(adapter.abstract(jax.random.key(0))[0])))
    return (divides_by_data(traced.jaxpr, len(jax.tree.leaves(batch))), forward_flops(traced),
            roles)  # fmt: skip


def step_maker(adapter: Any, loss_fn: Any, optimizer: Any, strategy: Any, mesh: Any,
               settings: Any, state_shardings: Any, loss_normalised: bool,
               train: bool = True, roles: Any = None) -> Callable[[Any], Callable]:  # fmt: skip
    """``step_for(batch_shardings)``: the traced training step (:func:`make_step`) of a
    run's parts and :class:`~shardplug.settings.Settings`, or with ``train=False`` the
    evaluation step, for :func:`build` to compile; ``state_shardings``: where the state
    lives (its arrays in host memory brought to the devices inside the step)."""
    placed = state_shardings if memory.any_off(state_shardings) else None
    param_shardings = memory.on_device_shardings(state_shardings.params)
    on_host = strategy.update_memory(state_shardings, mesh) == "host"

    def step_for(batch_shardings: Any) -> Callable:
        if not train:
            return make_eval_step(adapter, loss_fn, strategy, mesh, placed)
        return make_step(
            adapter, loss_fn, optimizer, strategy, mesh, param_shardings=param_shardings,
            batch_shardings=batch_shardings, skip_nonfinite=settings.on_nonfinite == "skip",
            grad_accum=settings.grad_accum, precision=settings.precision,
            loss_normalised=loss_normalised, placed=placed, update_on_host=on_host, roles=roles,
        )  # fmt: skip

    return step_for
