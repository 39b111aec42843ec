"""Expert parallel over the `expert` axis: a mixture of experts' experts split across devices.

A parameter dimension the model names ``expert`` (the leading dimension of the stacked
expert weights, :mod:`shardplug.moe`) is split over ``expert``: each device holds ``E / n``
experts, and their Adam state. The batch's rows split over ``expert`` too (it is a batch
axis: the non-expert layers see it as data parallel; an ``fsdp`` beside it also stores the
other parameters over it). While the step is traced, :func:`shardplug.moe.routed_experts`
sends each device's token assignments to their experts' devices and back with
``all_to_all`` (:mod:`shardplug.core.experts`), so the experts compute only the tokens
routed to them, as one grouped product each. Dropless routing and capacity dropping give
what one device gives.
"""

from __future__ import annotations

from typing import ClassVar

from shardplug.plugin import Axis, Capability, ConfigError, expert_parallel, hookimpl


class ExpertParallel:
    """Expert parallel: experts split over `expert`, tokens sent to them by all-to-all."""

    unsupported: ClassVar[dict[str, str]] = {
        Capability.UNEVEN_SHAPES: "expert parallelism needs a mixture of experts",
        Capability.WITHOUT_EXPERTS: "expert parallelism splits a mixture of experts' experts; "
        "a model without them has nothing to split",
    }

    @hookimpl
    def parallel_axis(self):
        return Axis("expert", rank=Axis.EXPERT, batch=True, logical=("expert",), lends=True)

    @hookimpl
    def split_param(self, shape, logical, axis, size, taken):
        names = list(logical)
        if "expert" in names:
            dim = names.index("expert")
            if dim not in taken and shape[dim] % size:
                raise ConfigError(
                    f"{shape[dim]} experts do not split over the {size} devices of {axis!r}: "
                    f"use a number of experts that {size} divides (--experts), or fewer "
                    f"expert devices (--mesh)"
                )
            return None if dim in taken else dim
        return None

    @hookimpl
    def check_layout(self, paths, specs, axis):
        if not any(axis in tuple(spec) for spec in specs):
            raise ConfigError(
                f"ep splits a mixture of experts' stacked expert weights (a dimension named "
                f"'expert') over {axis!r}, and this model has none: give it experts "
                f"(shardplug.moe; the reference transformer's --experts E), or leave ep out"
            )

    @hookimpl
    def trace_context(self, axis, mesh, batch_axes):
        if mesh.shape[axis] == 1:
            return None
        return expert_parallel(axis, batch_axes)
