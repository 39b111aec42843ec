"""Pipeline parallel over the `stage` axis: a layer stack's layers split into stages.

A model's layer stack (:mod:`shardplug.stack`) has its leading layer dimension split over
``stage``: stage ``s`` holds L/S consecutive layers, or V non-adjacent chunks of L/(V*S)
(``repeats=V``: circular, interleaved). The batch is cut into M microbatches and the
activations passed between stages with ``ppermute``, by one of two engines:

- ``gpipe``: pp supplies the layer stack operation, whose schedule
  (:mod:`shardplug.strategies.pp.stages`) runs every microbatch's forward pass inside the model's,
  autodiff its backward; bubble (S-1)/(V*M+S-1), every microbatch's stage inputs held;
- the schedules that write the backward pass in (``1f1b``, ``interleaved-1f1b``, ``zb``,
  ``zbv``, or a :class:`shardplug.plugin.Schedule` of a plugin's): pp's ``compute_grads``
  runs the table of F, B and W passes (:mod:`shardplug.strategies.pp.ticks`), at most about
  S microbatches' activations held whatever M; ZB-H1's bubble (S-1)/(3M+S-1), ZB-V's (two
  chunks per stage placed in a V) (S-1)/(6M+S-1).

The default, ``auto``, is ``zb`` (``interleaved-1f1b`` with ``repeats``) where the model lets
it and GPipe where not, said once (docs/guide.md, "Pipeline schedules", has the measurements
behind it). The layers before and after the stack (embeddings, head) are replicated over
``stage`` and split by the other parallelisms of the composition (``pp+fsdp+tp``: 3D
parallelism). explain shows the schedule's figures (:mod:`.report`). The default M is 4 x
stages, or the largest divisor of the batch below that.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
from jax.sharding import PartitionSpec as P

from shardplug.plugin import (
    LAYERS,
    RANK,
    Axis,
    Capability,
    ConfigError,
    Explained,
    Operations,
    Schedule,
    StrategyOptionError,
    Table,
    TraceAgain,
    Unscheduled,
    hookimpl,
    mesh_axes,
    warn_once,
)
from shardplug.strategies.pp import blocks
from shardplug.strategies.pp.checks import divergent_permutes, unordered_collectives
from shardplug.strategies.pp.chunks import NEVER_RAN
from shardplug.strategies.pp.report import pipeline_report, written_report
from shardplug.strategies.pp.schedules import find_schedule
from shardplug.strategies.pp.stages import Pipeline, rows_split, stack_operation
from shardplug.strategies.pp.ticks import scheduled_grads

#: the schedule pp runs where none is asked for: ``auto``, zero-bubble (interleaved 1F1B over
#: ``repeats`` chunks) where the model lets it, GPipe where not (docs/guide.md, measured)
DEFAULT_SCHEDULE = "auto"


class PipelineParallel:
    """Pipeline parallel: a layer stack's layers split into stages over `stage`.

    :param microbatches: microbatches per step (M); 0 chooses 4 x stages, or the largest
        divisor of the batch below that (at least the stage count where the batch allows).
    :param repeats: chunks of layers per stage (V); above 1 the schedule is circular
        (interleaved), bubble (S-1)/(V*M+S-1), and M must be a multiple of the stages.
    :param remat: recompute each stage's activations in its backward pass, keeping only
        each layer's input; default: yes for ``gpipe`` (which otherwise keeps every
        microbatch's), no for the schedules that write the backward pass in (which hold at
        most about S microbatches' and run uneven ticks when B recomputes).
    :param schedule: ``auto`` (the default: ``zb``, or ``interleaved-1f1b`` with
        ``repeats``, where the model lets it, else ``gpipe``, said once with the reason),
        ``gpipe`` (every microbatch's forward pass, then autodiff's backward; circular with
        ``repeats``), ``1f1b``, ``interleaved-1f1b``, ``zb`` (zero-bubble ZB-H1) or ``zbv``
        (ZB-V: two chunks per stage in a V, so ``repeats`` is 2), a
        schedule registered under the entry-point group ``shardplug.schedules``, or a
        :class:`shardplug.plugin.Schedule`. All but ``gpipe`` write the backward pass into
        the schedule (:mod:`shardplug.strategies.pp.ticks`).
    """

    unsupported: ClassVar[dict[str, str]] = {
        Capability.WITHOUT_LAYER_STACK: "pipeline stages split a layer stack (shardplug.stack); a "
        "model without one has nothing to split",
        Capability.UNEVEN_SHAPES: "a model of two plain layers has no layer stack",
    }

    def __init__(self, microbatches: int = 0, repeats: int = 1, remat: bool | None = None,
                 schedule: str | Schedule = DEFAULT_SCHEDULE):  # fmt: skip
        if not isinstance(microbatches, int) or microbatches < 0:
            raise StrategyOptionError(
                f"pp option microbatches must be a non-negative integer, got {microbatches!r}"
            )
        if not isinstance(repeats, int) or repeats < 1:
            raise StrategyOptionError(
                f"pp option repeats must be a positive integer, got {repeats!r}"
            )
        self.auto = schedule == "auto"
        if self.auto:
            schedule = "interleaved-1f1b" if repeats > 1 else "zb"
        written = None if schedule == "gpipe" else find_schedule(schedule)
        if written is not None and written.repeats is not None:  # a V runs 2 chunks a stage
            if repeats not in (1, written.repeats):
                raise StrategyOptionError(
                    f"pp's {written.name} schedule runs {written.repeats} chunks of layers per "
                    f"stage, not repeats={repeats}: leave pp.repeats out"
                )
            repeats = written.repeats
        if written is not None and repeats > 1 and not (written.chunked or written.repeats):
            raise StrategyOptionError(
                f"pp option repeats={repeats} interleaves chunks of layers: use -o "
                f"pp.schedule=interleaved-1f1b (or gpipe's circular schedule), not "
                f"{written.name}"
            )
        if written is not None and written.chunked and repeats == 1:
            raise StrategyOptionError(
                f"pp's {written.name} schedule interleaves chunks of layers on each stage: "
                f"give -o pp.repeats=V with V >= 2 chunks per stage"
            )
        self.microbatches = microbatches
        self.repeats = repeats
        self.written = written
        self._remat = remat
        self._plan: Pipeline | None = None
        #: (stages, layers) where a leaf named 'layers' is not divided: said by check_layout
        self._undivided: tuple[int, int] | None = None
        self.table: Table | None = None  # the last step's, for explain

    @property
    def schedule(self) -> str:
        """The schedule the step runs: ``gpipe`` where ``auto`` fell back to it."""
        return "gpipe" if self.written is None else self.written.name

    @property
    def remat(self) -> bool:
        """Whether the schedule that runs recomputes activations (see the class)."""
        return (self.written is None) if self._remat is None else bool(self._remat)

    def _gpipe_instead(self, why: str) -> None:
        """``auto``: run GPipe from now on, saying once why."""
        self.written = None
        warn_once(f"pp runs gpipe, not its default zero-bubble schedule: {why}")

    @hookimpl
    def parallel_axis(self):
        return Axis("stage", rank=RANK["stage"])

    @hookimpl
    def split_param(self, shape, logical, axis, size, taken):
        names = tuple(logical)
        if not names or names[0] != LAYERS or 0 in taken:
            return None
        if shape[0] % (size * self.repeats):
            self._undivided = (size, shape[0])  # said by check_layout, which sees the paths
            return None
        return 0

    @hookimpl
    def check_layout(self, paths, specs, axis, leaves, logical):
        named = [tuple(lg)[:1] == (LAYERS,) for lg in logical]
        undivided, self._undivided = self._undivided, None
        said = blocks.listed(paths, leaves, named) if any(named) else None
        if said is not None:  # a rule named each block of a list a stack
            raise ConfigError(said)
        if undivided is not None:
            raise ConfigError(blocks.undivided(undivided[0], self.repeats, undivided[1]))
        if not any(len(spec) and spec[0] == axis for spec in specs):
            raise ConfigError(blocks.no_stack(axis, paths, leaves))

    @hookimpl
    def operations(self, axis, mesh, replicas):
        replicas = tuple(a for a in replicas if mesh.shape[a] > 1)
        gpipe_remat = True if self._remat is None else bool(self._remat)  # where it runs
        plan = Pipeline(
            axis, mesh.shape[axis], self.microbatches, self.repeats, gpipe_remat,
            replicas=replicas, replica_size=math.prod(mesh.shape[a] for a in replicas),
        )  # fmt: skip
        self._plan = plan
        return Operations(layer_stack=stack_operation(plan), unused=self._never_ran)

    def _never_ran(self, _: str) -> None:
        """GPipe's program traced without its stack operation: the layers stored over the
        stages would run in the model's own loop, every device computing every layer (the
        written-in schedules cut the loss at the stack and say so themselves)."""
        if self.written is None:
            raise ConfigError(f"pp splits a layer stack, and {NEVER_RAN}")

    @hookimpl
    def compute_grads(self, params, model_state, batch, rng, mesh, microbatches, prepare,
                      forward, param_shardings):  # fmt: skip
        if self.written is None or self._plan is None:
            return None  # gpipe: the layer stack operation runs it, autodiff the rest
        try:
            return self._scheduled(params, model_state, batch, rng, mesh, microbatches,
                                   prepare, forward, param_shardings)  # fmt: skip
        except Unscheduled as exc:  # what GPipe runs: under auto, GPipe runs it
            if not self.auto:
                raise
            self._gpipe_instead(str(exc).split(": use -o pp.schedule=gpipe")[0])
            return None

    def _scheduled(self, params, model_state, batch, rng, mesh, microbatches, prepare,
                   forward, param_shardings):  # fmt: skip
        if microbatches > 1:
            raise Unscheduled(
                f"pp's {self.schedule} schedule accumulates its microbatches itself: instead "
                f"of --grad-accum {microbatches}, give -o pp.microbatches=M (M times as many)"
            )
        if param_shardings is None:
            raise ConfigError(f"pp's {self.schedule} schedule needs the parameters' shardings")
        plan = self._plan
        manual = math.prod(mesh.shape[a] for a in plan.replicas)
        if _rows_split(batch) > manual:
            raise Unscheduled(
                f"pp's {self.schedule} schedule on explicit axes splits a microbatch's rows "
                f"only over axes that split no parameter ({', '.join(plan.replicas) or 'none'}"
                f" here), and this batch's rows are split over more"
            )
        specs = jax.tree.leaves(param_shardings, is_leaf=lambda s: hasattr(s, "spec"))
        stacked = [bool(len(s.spec)) and plan.axis in mesh_axes(P(s.spec[0])) for s in specs]
        rows = jax.tree.leaves(batch)[0].shape[0]
        plan = plan.resolve(rows)
        layers = next(
            (x.shape[0] for x, s in zip(jax.tree.leaves(params), stacked, strict=True) if s), 0
        )
        plan.check(layers, rows)
        self.table = self.written.table(plan.stages, plan.microbatches, plan.repeats)
        return scheduled_grads(
            self.table, forward, prepare(params), model_state, batch, rng, axis=plan.axis,
            replicas=plan.replicas,
            replica_size=manual,
            remat=self.remat,
            in_place=not _on_cpu(mesh),
        )  # fmt: skip

    @hookimpl
    def check_program(self, mesh, hlo):
        if self.written is None:
            return
        found = divergent_permutes(hlo)
        # A GPU runs a program's collectives in its order; XLA:CPU in each device's own.
        between = [] if found or not _on_cpu(mesh) else unordered_collectives(hlo)
        if found:
            brief = (f"the compiler made the model's {found[0]} a send between devices of every "
                     f"stage inside the pass one stage runs")  # fmt: skip
            line = (
                f"pp's {self.schedule} schedule runs different passes on different stages at "
                f"once, and the compiler made the model's {found[0]} a send between devices "
                f"of every stage inside one (a collective-permute), which would wait forever: "
                f"use -o pp.schedule=gpipe, or compute that operation on the whole array"
            )
        elif between:
            brief = (f"on CPU devices the compiler's {len(between)} {between[0]}s between the "
                     f"passes of a tick (the model's activations laid out two ways) could meet "
                     f"pp's sends in a different order on each device")  # fmt: skip
            line = (
                f"pp's {self.schedule} schedule on CPU devices: the compiler put "
                f"{len(between)} {between[0]}s between the passes of each tick (the model's "
                f"activations laid out one way in a pass and another in the buffer holding "
                f"them), which each CPU device runs in its own order against pp's sends, and "
                f"a device sending first would wait forever: use -o pp.schedule=gpipe"
            )
        else:
            return
        if not self.auto:
            raise ConfigError(line)
        self._gpipe_instead(brief)
        raise TraceAgain("pp runs gpipe instead")

    @hookimpl
    def explain_step(self, axis, mesh, step):
        if self.written is not None and self.table is not None:
            t = self.table
            report = written_report(t, self.written.formula(t.stages, t.microbatches, t.chunks),
                                    axis, mesh, step)  # fmt: skip
        else:
            report = pipeline_report(axis, mesh, step)
        return None if report is None else Explained(name="pipeline", report=report)


def _on_cpu(mesh) -> bool:
    return mesh.devices.flat[0].platform == "cpu"


def _rows_split(batch) -> int:
    """The devices the batch's rows are laid out over by their type (explicit axes)."""
    return max((rows_split(x) for x in jax.tree.leaves(batch)), default=1)
