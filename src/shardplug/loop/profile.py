"""A profiler trace of chosen steps (TensorBoard, Perfetto)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import jax


class Trace:
    """A profiler trace of the steps in ``steps`` (TensorBoard and Perfetto), when asked."""

    def __init__(self, directory: str | None, steps: range):
        self.directory, self.steps, self.active = directory, steps, False

    def wants(self, number: int) -> bool:
        """Whether step ``number`` is traced (the loop skips :meth:`step` otherwise)."""
        return self.directory is not None and (self.active or number == self.steps.start)

    @contextlib.contextmanager
    def step(self, number: int, state: Callable[[], Any]) -> Any:
        if self.directory is not None and number == self.steps.start:
            jax.block_until_ready(state())  # the trace holds these steps only
            directory = self.directory
            if jax.process_count() > 1:  # one trace per process, not one file fought over
                directory = os.path.join(directory, f"process_{jax.process_index()}")
            jax.profiler.start_trace(directory, create_perfetto_trace=True)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            yield
        if number + 1 == self.steps.stop:
            self.close(state())

    def close(self, state: Any) -> None:
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
