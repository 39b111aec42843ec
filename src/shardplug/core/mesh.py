"""Meshes: parsing ``--mesh`` strings and building a mesh over a list of devices."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

from shardplug.errors import MeshError

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> dict[str, int]:
    """Parse ``"data=2,model=4"`` into ``{"data": 2, "model": 4}``.

    >>> parse_mesh("data=2,model=4")
    {'data': 2, 'model': 4}
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


def describe(mesh: Mesh) -> str:
    """``data=2,model=4``: the mesh written the way ``--mesh`` takes it."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())
