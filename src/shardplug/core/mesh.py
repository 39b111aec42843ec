"""Meshes: parsing ``--mesh`` strings and building a mesh over a list of devices."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from shardplug.errors import ConfigError, MeshError

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> dict[str, int]:
    """Parse ``"a=2,b=4"`` into ``{"a": 2, "b": 4}``: axis names and sizes.

    >>> parse_mesh("a=2,b=4")
    {'a': 2, 'b': 4}
    """
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not _AXIS.match(name) or not size.isdigit() or int(size) < 1:
            raise MeshError(
                f"malformed mesh {text!r}: write AXIS=SIZE pairs separated by commas, "
                "sizes positive integers, e.g. data=2,model=4"
            )
        if name in shape:
            raise MeshError(f"malformed mesh {text!r}: axis {name!r} appears twice")
        shape[name] = int(size)
    return shape


def build_mesh(
    devices: Sequence[Any],
    mesh_shape: Mapping[str, int] | None,
    *,
    default: Mapping[str, int],
) -> Mesh:
    """Build a mesh over exactly ``devices``.

    ``mesh_shape`` is what the user asked for; it must name exactly the axes of ``default``
    (in any order; the mesh keeps ``default``'s order). Without it, ``default`` is used, where
    one size may be ``-1`` for "all the devices left". Axes are ``AxisType.Auto``: the compiler
    propagates shardings, as ``jax.jit`` with in/out shardings expects.
    """
    n = len(devices)
    if mesh_shape is None:
        shape = dict(default)
        rest = [name for name, size in shape.items() if size == -1]
        known = math.prod(size for size in shape.values() if size != -1)
        if len(rest) > 1 or known < 1 or n % known:
            raise MeshError(f"cannot lay out {n} devices as {shape}")
        for name in rest:
            shape[name] = n // known
    else:
        if set(mesh_shape) != set(default):
            raise MeshError(
                f"mesh axes {sorted(mesh_shape)} do not fit this strategy: "
                f"give sizes for exactly {sorted(default)}"
            )
        shape = {name: int(mesh_shape[name]) for name in default}
    size = math.prod(shape.values())
    if size != n:
        asked = ",".join(f"{k}={v}" for k, v in shape.items())
        raise MeshError(
            f"mesh {asked} has {size} devices but the run has {n}: "
            f"make the sizes multiply to {n}, or change --devices"
        )
    grid = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


#: the mesh modes a run may ask for (``--axis-types``): JAX's ``AxisType.Auto`` (the compiler
#: propagates shardings; ``with_sharding_constraint`` hints) or ``AxisType.Explicit``
#: (shardings are part of every array's type; ``jax.sharding.reshard`` moves them)
AXIS_TYPES = ("auto", "explicit")


def retyped(mesh: Mesh, axis_types: str) -> Mesh:
    """``mesh`` (its devices and axis names unchanged) with every axis of ``axis_types``."""
    kind = AxisType.Explicit if axis_types == "explicit" else AxisType.Auto
    if all(t == kind for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * len(mesh.axis_names))


def is_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` (a Mesh or an abstract mesh) has explicit axes."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def holds_explicit(tree: Any) -> bool:
    """Whether any array of ``tree`` is laid out on a mesh with explicit axes (a model built
    under ``jax.set_mesh`` of such a mesh carries them in its parameters' types)."""
    return any(
        is_explicit(getattr(getattr(leaf, "sharding", None), "mesh", None))
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    )


def explain_axis_types(asked: str | None, adapter: Any) -> tuple[str, str]:
    """The axis types a run starts with, and why: as asked, or explicit for a model whose
    parameters already live on an explicit mesh, auto otherwise (until its code says)."""
    if asked is not None:
        return asked, "asked for"
    if holds_explicit(getattr(adapter, "variables", None)):
        return "explicit", "the model's parameters live on a mesh with explicit axes"
    return "auto", "the default: the model's code and parameters need no explicit axes"


_NEEDS_EXPLICIT = re.compile(r"passed to (\S+) cannot contain axis names that are of type Auto")


def explicit_need(exc: BaseException, asked: str | None) -> str | None:
    """What in ``exc`` (or its causes) needs explicit mesh axes (JAX refusing a
    PartitionSpec on auto axes, or outside any mesh), when the run may still move onto them
    (``asked`` None); None when ``exc`` is about something else or explicit axes were asked
    for. Raises :class:`ConfigError` when auto axes were asked for."""
    need, seen = None, 0
    while exc is not None and seen < 8 and need is None:
        found = _NEEDS_EXPLICIT.search(str(exc))
        if found:
            need = f"jax {found.group(1)} with a PartitionSpec"
        elif "PartitionSpec when you are not under a mesh context" in str(exc):
            need = "a PartitionSpec while the model is built"
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    if need is not None and asked == "auto":
        raise ConfigError(
            f"the model's code needs explicit mesh axes ({need}), and axis_types 'auto' was "
            f"asked for: leave axis_types out, or ask for 'explicit'"
        )
    return None if asked == "explicit" else need


_MISSING_AXIS = re.compile(r"Resource axis: (\w+) of (.*?) is not found in mesh")


def model_axes_error(exc: BaseException, mesh: Any, batch_axes: tuple[str, ...]) -> Any:
    """The one line (a :class:`ConfigError`) for a model whose own code names mesh axes the
    run cannot give it: an axis the mesh lacks (JAX's ``Resource axis ... is not found in
    mesh``), or, on explicit axes, a layout JAX refuses that involves the batch's axes (rows
    placed over fewer axes than the batch's, a batch axis used for another dimension too);
    None for anything else."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if found := _MISSING_AXIS.search(text):
            axis, spec = found.groups()
            return ConfigError(
                f"the model's code names mesh axis {axis!r} (in {spec}), which this run's "
                f"mesh ({describe(mesh)}) does not have: compose the parallelism that splits "
                f"it under that name (--axis-name ROLE={axis}), "
                f"or give the mesh a {axis!r} axis of size 1 (--mesh {describe(mesh)},{axis}=1)"
            )
        if type(exc).__name__ == "ShardingTypeError" and is_explicit(mesh):
            first = (text.splitlines()[0] if text else type(exc).__name__).rstrip(".")
            rows = str(batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
            if rows and any(re.search(rf"\b{re.escape(a)}\b", text) for a in batch_axes):
                return ConfigError(
                    f"the model's code lays out arrays in a way JAX refuses on explicit axes "
                    f"({first}): the batch's rows are split over {rows}, so where the model "
                    f"places rows it must name those axes (P({rows}, ...)) and use them for "
                    f"nothing else; or leave out the parallelisms whose axes it does not name"
                )
            return ConfigError(
                f"the model's code computes something JAX refuses on explicit axes ({first}): "
                f"give that operation its output's sharding in the model (out_sharding=...), "
                f"or run on auto axes (leave axis_types / --axis-types out)"
            )
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def describe(mesh: Mesh) -> str:
    """``data=2,model=4``: the mesh written the way ``--mesh`` takes it."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())
