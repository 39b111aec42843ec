"""Batches on the host: their signature, and their rows placed on the devices."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardplug.core.sharding import leading_axes
from shardplug.errors import BatchError
from shardplug.running.distributed import process_rows


def signature(batch: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    """A batch's tree structure and its leaves' shapes and dtypes: what a program fits."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, [(np.shape(x), _dtype(x)) for x in leaves]


def check(batch: Any, index: int, expected: Any) -> None:
    """Refuse a batch that does not look like the one the program was compiled for."""
    if signature(batch) != expected:
        shapes = [shape for shape, _ in expected[1]]
        got = [shape for shape, _ in signature(batch)[1]]
        raise BatchError(
            f"batch {index} differs from the first batch in structure, shape or dtype "
            f"(first: {shapes}, this one: {got}): every batch must look alike"
        )


def global_shapes(signature: Any) -> list[list[int]]:
    """The global batch's leaf shapes (JSON), for a checkpoint to compare a resume against."""
    return [list(_global_shape(shape)) for shape, _ in signature[1]]


def check_resumed(batches: Any, meta: dict[str, Any] | None) -> None:
    """Refuse to resume a run from a checkpoint whose batches were shaped otherwise: its data
    position counts batches, so other batches would not continue the same run. ``batches``
    is the :func:`signature` of this run's batches, ``meta`` the checkpoint's JSON."""
    saved = (meta or {}).get("batch_shapes")
    shapes = global_shapes(batches)
    if saved is None or saved == shapes:
        return
    rows = {tuple(s[:1]) for s in saved} != {tuple(s[:1]) for s in shapes}
    what = ("batch size (another one would read other samples)" if rows else
            "sequence and sample shapes (its batches' other dimensions: another length reads "
            "other tokens)")  # fmt: skip
    raise BatchError(
        f"the checkpoint's run read batches of shapes {saved}, this one reads {shapes}: "
        f"resume with the same {what}, or start a new run in an empty directory"
    )



def put(batch: Any, shardings: Any) -> Any:
    """This process's rows of the batch as one global array in ``shardings``."""
    if jax.process_count() == 1:
        return jax.device_put(batch, shardings)  # the same, with less bookkeeping
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(
            s, np.asarray(x), _global_shape(np.shape(x))
        ),
        batch,
        shardings,
    )


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _global_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the global batch leaf a process's leaf of ``shape`` is part of: in a
    multi-process run each process holds an equal block of the leading (batch) dimension."""
    if shape and jax.process_count() > 1:
        return (shape[0] * jax.process_count(), *shape[1:])
    return tuple(shape)


def global_struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_global_shape(np.shape(x)), _dtype(x))


def check_process_rows(leaf: jax.ShapeDtypeStruct, sharding: NamedSharding) -> None:
    """The strategy must give this process exactly the rows it feeds."""
    if not leaf.shape:
        return
    want = process_rows(leaf.shape[0])
    rows = {
        index[0].indices(leaf.shape[0])[:2]
        for index in sharding.addressable_devices_indices_map(leaf.shape).values()
    }
    lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
    if (lo, hi) != (want.start, want.stop):
        raise BatchError(
            f"the strategy's batch sharding {sharding.spec} gives process "
            f"{jax.process_index()} rows {lo}..{hi - 1} of {leaf.shape[0]}, but each process "
            f"feeds its own block ({want.start}..{want.stop - 1}): split the batch over "
            f"axes whose devices are grouped by process"
        )


def check_microbatches(k: int, leaf: jax.ShapeDtypeStruct, sharding: NamedSharding) -> None:
    """Each of the ``k`` microbatches must split over the devices as the batch does."""
    if not leaf.shape:
        return
    parts = math.prod(sharding.mesh.shape[a] for a in leading_axes(sharding.spec))
    if leaf.shape[0] % (k * parts):
        raise BatchError(
            f"a batch of {leaf.shape[0]} rows does not cut into {k} microbatches that each "
            f"split over {parts} devices: use a global batch size that is a multiple of "
            f"{k * parts} (grad_accum x devices)"
        )


def batch_rows(signature: Any) -> int:
    """The global batch size: the leading dimension of the first leaf that has one."""
    shapes = [shape for shape, _ in signature[1] if shape]
    return int(shapes[0][0]) if shapes else 1
