"""Expert parallel over the `expert` axis: a mixture of experts' experts split across devices.

A parameter dimension the model names ``expert`` (the leading dimension of the stacked
expert weights, :mod:`shardplug.moe`) is split over ``expert``: each device holds ``E / n``
experts, and their Adam state. The batch's rows split over ``expert`` too (it is a batch
axis: the non-expert layers see it as data parallel; an ``fsdp`` beside it also stores the
other parameters over it). ep supplies :func:`shardplug.moe.routed_experts`'s operation
(:mod:`.exchange`): each device's token assignments go to their experts' devices and back
with ``all_to_all``, so the experts compute only the tokens routed to them, as one grouped
product each. Dropless routing and capacity dropping give
what one device gives.
"""

from __future__ import annotations

import math
from typing import ClassVar

from shardplug.plugin import (
    RANK,
    Axis,
    Capability,
    ConfigError,
    Explained,
    Operations,
    hookimpl,
    warn_once,
)
from shardplug.strategies.ep.exchange import exchange


class ExpertParallel:
    """Expert parallel: experts split over `expert`, tokens sent to them by all-to-all."""

    unsupported: ClassVar[dict[str, str]] = {
        Capability.UNEVEN_SHAPES: "expert parallelism needs a mixture of experts",
        Capability.WITHOUT_EXPERTS: "expert parallelism splits a mixture of experts' experts; "
        "a model without them has nothing to split",
    }

    #: set when a traced step never routed through shardplug.moe (explain shows it)
    unrouted_note: str | None = None

    @hookimpl
    def parallel_axis(self):
        return Axis("expert", rank=RANK["expert"], batch=True, logical=("expert",), lends=True)

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
    def check_layout(self, paths, specs, axis, leaves, logical):
        # split over the axis alone: what ep split, not what fsdp stores over its axis too
        mine = [(path, leaf) for path, spec, leaf in zip(paths, specs, leaves, strict=True)
                if axis in tuple(spec)]  # fmt: skip
        if not mine:
            raise ConfigError(
                f"ep splits a mixture of experts' stacked expert weights over {axis!r}: the "
                f"dimension a model names 'expert', and this model has none"
                f"{_near_misses(paths, logical)}: give it experts (shardplug.moe; the "
                f"reference transformer's --experts E), or leave ep out"
            )
        self._experts = mine

    @hookimpl
    def operations(self, axis, mesh, batch_axes):
        if mesh.shape[axis] == 1:
            return None
        self.unrouted_note = None
        return Operations(
            experts=exchange(axis, tuple(batch_axes)), unused=lambda _: self._unrouted(axis, mesh)
        )

    def _unrouted(self, axis: str, mesh) -> None:
        """Say once that the model's experts were not routed through shardplug.moe: ep then
        moves no token, and the compiler gathers the experts to wherever the tokens are."""
        size = mesh.shape[axis]
        whole = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for _, leaf in self._experts)
        gathered = whole * (size - 1) // size
        self.unrouted_note = (
            f"ep: the model never called shardplug.moe.routed_experts, so no token moved by "
            f"all-to-all: the compiler gathers its experts ({_size(whole)} whole, stored "
            f"1/{size} per device over {axis!r}; {', '.join(p for p, _ in self._experts[:3])}) "
            f"onto every device, at least {_size(gathered)} per device per step; route with "
            f"shardplug.moe.route and shardplug.moe.routed_experts to send the tokens to their "
            f"experts instead"
        )
        warn_once(self.unrouted_note)

    @hookimpl
    def explain_step(self, step):
        if self.unrouted_note is None:
            return None
        gathered = sum(c["bytes"] for c in step.collectives if c["kind"] == "all-gather")
        return Explained(
            notes=(f"{self.unrouted_note} (the compiled step all-gathers {_size(gathered)})",)
        )


def _near_misses(paths: list[str], logical: list) -> str:
    """The dimensions a model named for experts otherwise ('experts', 'num_experts'), which
    ep did not take."""
    found = sorted({
        (name, path) for path, spec in zip(paths, logical, strict=True)
        for entry in spec for name in (entry if isinstance(entry, tuple) else (entry,))
        if isinstance(name, str) and "expert" in name.lower() and name != "expert"
    })  # fmt: skip
    if not found:
        return ""
    names = sorted({name for name, _ in found})
    return (
        f" (it names {', '.join(map(repr, names))} on {found[0][1]}, a dimension ep does not "
        f"take: name it 'expert', or map it with the adapter's rules)"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} kiB"
