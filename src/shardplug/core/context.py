"""What a model may ask about the step it is traced in."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_BATCH_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "shardplug_batch_axis", default=None
)


def batch_axis_name() -> str | None:
    """The mesh axis the batch is split over, inside an explicit per-device program.

    Under ``jax.jit`` strategies (dp, fsdp, 2d) the step is written for the global batch and
    this is None: a batch mean is already the global one. Inside a per-device program (pmap)
    each device sees only its rows, and batch statistics must be averaged over this axis to
    be those of the global batch. Pass it where a layer takes one::

        nn.BatchNorm(use_running_average=not train, axis_name=shardplug.batch_axis_name())
    """
    return _BATCH_AXIS.get()


@contextlib.contextmanager
def per_device_program(axis: str) -> Iterator[None]:
    """Trace the code inside as one device's program, its batch split over ``axis``."""
    token = _BATCH_AXIS.set(axis)
    try:
        yield
    finally:
        _BATCH_AXIS.reset(token)
