"""Where a run's arrays live, decided in one place: the mesh, its axis types and why, and the
training state's shardings, as a value.

:meth:`Layout.decide` makes it from the strategy, the model and the devices. The axis types
are as asked, or explicit for a model whose parameters already live on an explicit mesh,
or auto until the model's own code turns out to need explicit axes: :meth:`Layout.attempt`
runs a piece of set-up or tracing and, when JAX refuses the model's code on auto axes (and
the mode was left to choose), runs it again on the layout moved onto explicit axes
(:meth:`Layout.on_explicit`), returning the layout it ran on. A model whose code names mesh
axes the run cannot give it is refused in one line (``model_axes_error``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from shardplug.core.devices import select_devices
from shardplug.core.mesh import (
    explain_axis_types,
    explicit_need,
    model_axes_error,
    parse_mesh,
    retyped,
)
from shardplug.core.state import state_shardings
from shardplug.core.step import TrainState
from shardplug.core.strategy import Strategy
from shardplug.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's mesh and shardings (see the module)."""

    strategy: Strategy
    mesh: Any
    #: "auto" or "explicit", and why
    axis_types: str
    axis_types_reason: str
    #: what the run asked for (None: chosen for the model)
    asked: str | None
    #: the model's parameters and state as ``jax.ShapeDtypeStruct``, and its annotations
    abstract: tuple[Any, Any] | None = None
    annotations: Any = None
    #: every state array's ``NamedSharding``, and the optimizer its state follows
    shardings: TrainState | None = None
    optimizer: Any = None

    @classmethod
    def decide(
        cls,
        strategy: Strategy,
        adapter: Any,
        optimizer: Any,
        *,
        devices: int | Sequence[Any] | None,
        mesh: str | Mapping[str, int] | None,
        axis_types: str | None,
        rng: jax.Array,
    ) -> Layout:
        """The layout of a run: the mesh (over ``devices``: how many of the default backend's,
        all for None, or the devices themselves; sized as ``mesh`` says, ``"a=2,b=4"`` or a
        dict), then the model's shapes and annotations, then the state's shardings (each
        step moving onto explicit axes if the model needs them)."""
        if devices is None or isinstance(devices, int):
            devices = select_devices(devices)
        shape = parse_mesh(mesh) if isinstance(mesh, str) else _sizes(mesh)
        types, why = explain_axis_types(axis_types, adapter)
        mesh = strategy.make_mesh(list(devices), shape, types)
        layout = cls(strategy, mesh, types, why, axis_types)
        abstract, layout = layout.attempt(lambda: adapter.abstract(rng), build=True)
        layout = dataclasses.replace(layout, abstract=abstract)
        annotations, layout = layout.attempt(lambda: adapter.annotations(abstract[0]), build=True)
        layout = dataclasses.replace(layout, annotations=annotations)
        return layout.placed(optimizer)

    def placed(self, optimizer: Any) -> Layout:
        """This layout with the state's shardings on its mesh, as the strategy chooses."""
        params, model_state = self.abstract
        shardings = state_shardings(
            self.strategy, self.mesh, optimizer, params, model_state, self.annotations
        )
        return dataclasses.replace(self, shardings=shardings, optimizer=optimizer)

    def attempt(
        self,
        fn: Callable[[], Any],
        *,
        build: bool = False,
        moving: Callable[[Layout], None] | None = None,
    ) -> tuple[Any, Layout]:
        """``fn()`` on this layout, and the layout it ran on: again on explicit axes when the
        model's code needs them and the mode was left to choose (``moving(new layout)`` is
        told first, so that what ``fn`` reads is on it). ``build``: ``fn`` builds the model,
        which on explicit axes happens under the run's mesh (it may reshard in its forward
        pass); on auto axes it is built outside any mesh (a Flax model's partition metadata
        names logical axes only the strategy maps)."""
        try:
            return self._refusing(fn, build), self
        except Exception as exc:
            need = explicit_need(exc, self.asked)
            if need is None:
                raise
        moved = self.on_explicit(need)
        if moving is not None:
            moving(moved)
        return moved._refusing(fn, build), moved

    def place(self, state: Any, allocated: bool = True) -> Any:
        """``state`` in this layout's shardings (only described, when not ``allocated``)."""
        return jax.tree.map(
            lambda x, s: jax.device_put(x, s) if allocated
            else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state, self.shardings,
        )  # fmt: skip

    def on_explicit(self, need: str) -> Layout:
        """This layout on explicit axes: the same devices, axis names and layouts."""
        self.strategy.check_explicit()
        moved = dataclasses.replace(
            self,
            mesh=retyped(self.mesh, "explicit"),
            axis_types="explicit",
            axis_types_reason=f"the model's code needs explicit axes ({need})",
        )
        return moved.placed(self.optimizer) if self.shardings is not None else moved

    def _refusing(self, fn: Callable[[], Any], build: bool) -> Any:
        try:
            if build and self.axis_types == "explicit":
                with jax.set_mesh(self.mesh):
                    return fn()
            return fn()
        except Exception as exc:
            composition = self.strategy.composition
            batch_axes = composition.batch_axes if composition is not None else ()
            refused = model_axes_error(exc, self.mesh, batch_axes)
            if refused is not None:
                raise refused from exc
            raise


def _sizes(mesh: Any) -> dict[str, int] | None:
    """A mesh given as a mapping: each axis name's size, a positive integer (None: none)."""
    if mesh is None:
        return None
    def size(v: Any) -> int:
        if isinstance(v, bool):
            raise TypeError(v)
        return operator.index(v)  # an int, or numpy's

    try:
        sizes = {k: size(v) for k, v in mesh.items() if isinstance(k, str)}
    except (AttributeError, TypeError):
        sizes = {}
    if not sizes or len(sizes) != len(mesh) or min(sizes.values()) < 1:
        raise ConfigError(f"mesh={mesh!r}: give 'data=2,model=4' or a dict of axis names to "
                          "positive integer sizes, e.g. {'data': 2, 'model': 4}")  # fmt: skip
    return sizes
