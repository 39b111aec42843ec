"""What a model may ask about the step it is traced in."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from shardplug.core.sharding import lay_out

_BATCH_AXIS: contextvars.ContextVar[str | tuple[str, ...] | None] = contextvars.ContextVar(
    "shardplug_batch_axis", default=None
)
_MANUAL_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "shardplug_manual_axes", default=()
)
_RULES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "shardplug_activation_rules", default=None
)
_COMPUTE: contextvars.ContextVar[Any] = contextvars.ContextVar("shardplug_compute", default=None)
_ROWS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "shardplug_batch_axes", default=()
)
_IN_PARTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardplug_microbatched", default=False
)


def compute_dtype() -> Any:
    """The dtype the step computes in under mixed precision (``jnp.bfloat16`` for
    ``precision="bf16"``), or None when it computes in the parameters' own dtype.

    The parameters a model sees are already cast; ask for this where a model makes floating
    arrays of its own (position tables, masks, RoPE angles) so they do not promote its
    bfloat16 activations back to float32::

        angles = (positions[:, None] * freqs).astype(shardplug.compute_dtype() or x.dtype)
    """
    return _COMPUTE.get()


@contextlib.contextmanager
def computing_in(dtype: Any) -> Iterator[None]:
    """Trace the code inside as a step that computes in ``dtype`` (None: the parameters')."""
    token = _COMPUTE.set(dtype)
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def batch_axis_name() -> str | tuple[str, ...] | None:
    """The mesh axis (or axes) the batch is split over, inside an explicit per-device program.

    Under ``jax.jit`` strategies (every composition of parallelisms) the step is written for
    the global batch and this is None: a batch mean is already the global one. Inside a
    per-device program each device sees only its rows, and batch statistics must be
    averaged over this axis to be those of the global batch. Pass it where a layer takes one
    (``lax.pmean`` takes a name or a tuple of names alike)::

        nn.BatchNorm(use_running_average=not train, axis_name=shardplug.batch_axis_name())
    """
    return _BATCH_AXIS.get()


def batch_axes() -> tuple[str, ...]:
    """The mesh axes the batch's rows are split over while the step is traced (in mesh
    order; empty outside a step, and for a whole strategy). Code that works on each
    device's own rows (a mixture of experts sorting its tokens) takes them as manual axes."""
    return _ROWS.get()


@contextlib.contextmanager
def splitting_rows(axes: tuple[str, ...]) -> Iterator[None]:
    """Trace the code inside with the batch's rows split over ``axes``."""
    token = _ROWS.set(tuple(axes))
    try:
        yield
    finally:
        _ROWS.reset(token)


def microbatched() -> bool:
    """Whether the code being traced sees the batch one microbatch at a time (inside a
    schedule that runs a layer stack on microbatches): what it counts over its rows (an
    expert's capacity) is then counted per microbatch, not over the batch."""
    return _IN_PARTS.get()


@contextlib.contextmanager
def in_microbatches() -> Iterator[None]:
    """Trace the code inside as seeing the batch one microbatch at a time."""
    token = _IN_PARTS.set(True)
    try:
        yield
    finally:
        _IN_PARTS.reset(token)


def manual_axes() -> tuple[str, ...]:
    """Every mesh axis the current per-device program is manual over (empty under jit).

    A decision every device must take alike (skip a non-finite step, stop) is agreed over
    all of them, not only over the batch's.
    """
    return _MANUAL_AXES.get()


@contextlib.contextmanager
def per_device_program(
    axis: str | tuple[str, ...], manual: tuple[str, ...] | None = None
) -> Iterator[None]:
    """Trace the code inside as one device's program, its batch split over ``axis``.

    :param axis: the batch's mesh axis, or a tuple of them.
    :param manual: every axis the program is manual over (default: the batch's).
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    batch_token = _BATCH_AXIS.set(axis)
    manual_token = _MANUAL_AXES.set(tuple(manual) if manual is not None else axes)
    try:
        yield
    finally:
        _MANUAL_AXES.reset(manual_token)
        _BATCH_AXIS.reset(batch_token)


@contextlib.contextmanager
def activation_rules(rules: Mapping[str, Any] | None) -> Iterator[None]:
    """Trace the code inside with ``rules`` (logical name -> mesh axes) for :func:`constrain`."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def logical_spec(names: tuple[str | None, ...]) -> P | None:
    """``names`` mapped by the current step's rules; None outside a step or where none maps."""
    rules = _RULES.get()
    if rules is None or _MANUAL_AXES.get():
        return None
    mesh = jax.sharding.get_abstract_mesh()  # a schedule's manual axes are not the model's
    used = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if t == jax.sharding.AxisType.Manual}  # fmt: skip
    out: list[Any] = []
    for name in names:
        axes = rules.get(name) if name is not None else None
        if isinstance(axes, str):
            axes = (axes,)
        axes = tuple(a for a in axes or () if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if all(entry is None for entry in out):
        return None
    return P(*out)


def sharding_of(names: tuple[str | None, ...]) -> P:
    """The ``PartitionSpec`` that logical dimension ``names`` map to under the current step's
    rules: what a model on explicit mesh axes passes as ``out_sharding`` (``jnp.einsum``,
    ``.at[...].get``) or to ``jax.sharding.reshard``, so that it runs under any strategy.

    ``jnp.einsum("bld,df->blf", x, w, out_sharding=shardplug.sharding_of(("batch", None,
    "mlp")))`` splits the result's rows as the batch and its last dimension over tensor
    parallelism's axis; a name nothing maps stays whole (``None``), as does every name
    outside a training step.
    """
    spec = logical_spec(tuple(names))
    return P(*([None] * len(names))) if spec is None else spec


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation's layout by logical dimension names, mapped by the run's rules.

    ``shardplug.constrain(h, ("batch", "length", "mlp"))`` splits ``h``'s first dimension over
    the mesh axes the batch splits over and its last over tensor parallelism's axis, under
    whatever composition runs; a name no parallelism of the run maps stays whole. Outside a
    training step, inside a per-device program, or where nothing maps, it returns ``x``
    unchanged, so a model that calls it runs anywhere.
    """
    if len(names) != jax.numpy.ndim(x):
        from shardplug.errors import ConfigError

        raise ConfigError(
            f"constrain got {len(names)} names {names} for an array of shape {jax.numpy.shape(x)}:"
            " give one name (or None) per dimension"
        )
    spec = logical_spec(tuple(names))
    return x if spec is None else lay_out(x, spec)
