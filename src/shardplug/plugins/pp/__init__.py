"""Pipeline parallel over the `stage` axis: a layer stack's layers split into stages.

A model's layer stack (:mod:`shardplug.stack`) has its leading layer dimension split over
``stage``: stage ``s`` holds L/S consecutive layers (GPipe) or R non-adjacent groups of
L/(R*S) (circular, ``repeats=R``). pp supplies the layer stack operation: every stack call
in the step runs the schedule of :mod:`shardplug.plugin.stages`, the batch cut into M
microbatches, activations passed to the next stage with ``ppermute``, the backward pass by
autodiff through the schedule; explain shows its figures (:mod:`.report`). The
layers before and after the stack (embeddings, head) are replicated over ``stage`` and
split by the other parallelisms of the composition (``pp+fsdp+tp``: 3D parallelism).

Idle share of each stage (the bubble): (S-1)/(R*M+S-1). Four stages need 27 microbatches
for 90% of their ticks busy (GPipe); the default is 4 x stages, or the largest divisor of
the batch below that.
"""

from __future__ import annotations

import math
from typing import ClassVar

from shardplug.plugin import (
    LAYERS,
    RANK,
    Axis,
    Capability,
    ConfigError,
    Explained,
    Operations,
    Pipeline,
    StrategyOptionError,
    hookimpl,
    stack_operation,
)
from shardplug.plugins.pp.report import pipeline_report


class PipelineParallel:
    """Pipeline parallel: a layer stack's layers split into stages over `stage`.

    :param microbatches: microbatches per step (M); 0 chooses 4 x stages, or the largest
        divisor of the batch below that (at least the stage count where the batch allows).
    :param repeats: groups of layers per stage (R); above 1 the schedule is circular
        (interleaved), bubble (S-1)/(R*M+S-1), and M must be a multiple of the stages.
    :param remat: recompute each stage's activations in the backward pass (memory: the
        stage inputs of every microbatch, not every activation); False keeps them.
    """

    unsupported: ClassVar[dict[str, str]] = {
        Capability.WITHOUT_LAYER_STACK: "pipeline stages split a layer stack (shardplug.stack); a "
        "model without one has nothing to split",
        Capability.UNEVEN_SHAPES: "a model of two plain layers has no layer stack",
    }

    def __init__(self, microbatches: int = 0, repeats: int = 1, remat: bool = True):
        if not isinstance(microbatches, int) or microbatches < 0:
            raise StrategyOptionError(
                f"pp option microbatches must be a non-negative integer, got {microbatches!r}"
            )
        if not isinstance(repeats, int) or repeats < 1:
            raise StrategyOptionError(
                f"pp option repeats must be a positive integer, got {repeats!r}"
            )
        self.microbatches = microbatches
        self.repeats = repeats
        self.remat = bool(remat)

    @hookimpl
    def parallel_axis(self):
        return Axis("stage", rank=RANK["stage"])

    @hookimpl
    def split_param(self, shape, logical, axis, size, taken):
        names = tuple(logical)
        if not names or names[0] != LAYERS or 0 in taken:
            return None
        if shape[0] % (size * self.repeats):
            what = f"{size} stages" if self.repeats == 1 else f"{size} stages x {self.repeats}"
            raise ConfigError(
                f"{what} do not divide the layer stack's {shape[0]} layers: choose a layer "
                f"count that is a multiple of {size * self.repeats} (--layers), or another "
                f"stage count (--mesh stage=N)"
            )
        return 0

    @hookimpl
    def check_layout(self, paths, specs, axis):
        if not any(len(spec) and spec[0] == axis for spec in specs):
            raise ConfigError(
                f"pp splits a layer stack over {axis!r}, and this model has none: build its "
                f"blocks with shardplug.stack (nnx_layers, LinenLayers or equinox_layers); "
                f"Equinox blocks, and Linen blocks without sharding annotations, also name "
                f"the stack's leading dimension in the adapter's rules, e.g. "
                f"rules={{r'blocks/.*': ('layers',)}}"
            )

    @hookimpl
    def operations(self, axis, mesh, replicas):
        replicas = tuple(a for a in replicas if mesh.shape[a] > 1)
        plan = Pipeline(
            axis, mesh.shape[axis], self.microbatches, self.repeats, self.remat,
            replicas=replicas, replica_size=math.prod(mesh.shape[a] for a in replicas),
        )  # fmt: skip
        return Operations(layer_stack=stack_operation(plan))

    @hookimpl
    def explain_step(self, axis, mesh, step):
        report = pipeline_report(axis, mesh, step)
        return None if report is None else Explained(name="pipeline", report=report)
