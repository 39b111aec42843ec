"""The host loop of ``Trainer.fit``: dispatch, the in-flight bound, metrics, checkpoints."""

from __future__ import annotations

import collections
import itertools
import math
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from shardplug.core.step import NONFINITE
from shardplug.errors import (
    BatchError,
    ConfigError,
    NonFiniteError,
    ShardplugWarning,
    TrainingInterrupted,  # fmt: skip
)
from shardplug.loop import feed, heartbeat
from shardplug.loop.metrics import StepFacts, device_rows, peak_tflops
from shardplug.loop.profile import Trace
from shardplug.loop.program import Program, RunState, place
from shardplug.loop.saving import RunCheckpoints
from shardplug.loop.signals import StopSignals
from shardplug.loop.waits import DataWait, Interrupted

# Steps the loop lets run ahead of the devices. Enough to keep them busy; a deeper queue
# only holds more batches in memory, and on the CPU backend a deep queue of programs with
# collectives can starve its thread pool until a rendezvous times out (seen at ~100).
MAX_IN_FLIGHT = 4
_END = object()
_STOPPED = object()  # a signal ended the wait for the next batch


class _Failed(NamedTuple):
    error: Exception


def compiled_on_first(
    iterator: Iterator[Any], compile: Callable[[Any], None], steps: int
) -> Iterator[Any] | None:
    """``compile(first batch)``, and the iterator with that batch back in front; None (said
    in a warning) when there is no batch."""
    done = object()
    first = next(iterator, done)
    if first is done:
        warnings.warn(f"batches ran out after 0 of {steps} steps", ShardplugWarning, 3)
        return None
    if first is None or not jax.tree.leaves(first):  # fit([None, None]) "ran out" at once
        raise ConfigError(f"the first batch is {first!r}: a batch is a pytree of arrays (a "
                          "dict of them, say), and batches an iterable of those")  # fmt: skip
    compile(first)
    return itertools.chain([first], iterator)


def run(
    settings: Any,
    program: Program,
    state: RunState,
    iterator: Iterator[Any],
    steps: int,
    *,
    mesh: Any,
    checkpoints: RunCheckpoints | None = None,
    callback: Callable[[list[dict[str, float]]], None] | None = None,
    evaluate: tuple[int, Callable[[], dict[str, float]]] | None = None,
) -> list[dict[str, float]]:
    """Run ``steps`` steps of ``program`` on ``iterator`` from ``state``; the new rows.

    ``settings`` (a :class:`shardplug.settings.Settings`) says how: ``log_every``,
    ``checkpoint_every``, ``on_nonfinite``, the profile window, ``data_timeout`` and what
    the rows' FLOP/s are counted against. ``state`` is updated in place (its leaves, step,
    history and skipped steps); ``checkpoints`` saves it.

    The loop waits on the devices only to read metrics (every ``log_every`` steps), keeps at
    most :data:`MAX_IN_FLIGHT` steps dispatched, checkpoints on schedule, and turns SIGINT
    and SIGTERM into a saved stop. The next batch is read and put on the devices right
    after a step is dispatched, while the devices run it: they never wait for the host's
    next batch unless making one takes longer than a step. (A background thread did this
    before; handing each batch across threads cost more host time than a small step.)
    """
    loop = _Run(settings, program, state, iterator, steps, mesh, checkpoints, callback, evaluate)
    with (
        StopSignals(enabled=checkpoints is not None) as stop,
        DataWait(settings.data_timeout) as wait,
    ):
        stop.wait = wait
        loop.wait = wait
        try:
            loop.take_steps(stop)
            loop.finish(stop)
        finally:
            heartbeat.end()
            loop.trace.close(state.leaves)
            if checkpoints is not None:
                checkpoints.wait()
    if stop.requested:
        raise loop.interrupted(stop.requested)
    return loop.rows


class _Run:
    """One call of :func:`run`: the rows it made, the steps dispatched and not yet read, the
    steps still in flight, and the clock the rows' step time is read from."""

    def __init__(
        self,
        settings: Any,
        program: Program,
        state: RunState,
        iterator: Iterator[Any],
        steps: int,
        mesh: Any,
        checkpoints: RunCheckpoints | None,
        callback: Callable[[list[dict[str, float]]], None] | None,
        evaluate: tuple[int, Callable[[], dict[str, float]]] | None,
    ):
        self.settings, self.program, self.state = settings, program, state
        self.iterator, self.steps, self.mesh = iterator, steps, mesh
        self.checkpoints, self.callback, self.evaluate = checkpoints, callback, evaluate
        self.rows: list[dict[str, float]] = []
        self.pending: list[dict[str, jax.Array]] = []
        self.started = time.perf_counter()
        self.first_step = state.step
        self.trace = Trace(settings.profile_dir, settings.profile_steps)
        self.in_flight: collections.deque = collections.deque()
        self.wait: DataWait | None = None  # the run's, once it has begun

    def take_steps(self, stop: StopSignals) -> None:
        """Dispatch the steps, each with the batch read while the one before it ran, until
        ``steps`` are done, a signal stops them or the batches run out."""
        ahead = self.fetch(0)
        for i in range(self.steps):
            if stop.requested or ahead is _STOPPED:
                break
            if ahead is None:
                self.ran_out(i)
                break
            if isinstance(ahead, _Failed):
                raise ahead.error
            self.dispatch(ahead)
            ahead = self.fetch(i + 1)
            self.on_schedule(stop)

    def fetch(self, i: int) -> Any:
        """Batch ``i`` read, checked and on its way to the devices; None when none is left.
        Called right after step i-1 is dispatched, so it is made while the devices compute."""
        if i == self.steps:
            return None
        try:
            self.wait.begin(self.first_step + i)
            batch = next(self.iterator, _END)
            return None if batch is _END else place(self.program, batch, self.first_step + i)
        except Interrupted:  # SIGTERM or Ctrl-C while waiting: stop after the last step
            return _STOPPED
        except Exception as exc:  # raised at its own step, after the steps before it
            return _Failed(exc)
        finally:
            self.wait.end()

    def ran_out(self, i: int) -> None:
        """The batches ran out after ``i`` steps: an error in a job of many processes, else
        a warning."""
        if jax.process_count() > 1:  # the others would wait for it forever
            raise BatchError(
                f"process {jax.process_index()}'s batches ran out after {i} of "
                f"{self.steps} steps: every process of a job must read as many"
            )
        # stacklevel 4: run's caller, past this method, take_steps and run
        warnings.warn(f"batches ran out after {i} of {self.steps} steps", ShardplugWarning, 4)

    def dispatch(self, batch: Any) -> None:
        """Dispatch one step on ``batch`` (in the profiler's trace where it wants the step),
        first waiting for the oldest step in flight when :data:`MAX_IN_FLIGHT` are."""
        state = self.state
        if len(self.in_flight) == MAX_IN_FLIGHT:  # a step long done: no stall
            oldest = self.in_flight.popleft()
            if not oldest.is_ready():
                oldest.block_until_ready()
        if self.trace.wants(state.step):
            with self.trace.step(state.step, lambda: state.leaves):
                state.leaves, metrics = self.program.compiled(state.leaves, batch)
        else:
            state.leaves, metrics = self.program.compiled(state.leaves, batch)
        state.step += 1
        heartbeat.beat(state.step)
        self.pending.append(metrics)
        self.in_flight.append(metrics["loss"])

    def on_schedule(self, stop: StopSignals) -> None:
        """After a step: read the metrics every ``log_every`` steps and before a checkpoint or
        an evaluation falls due (every process agreeing there on a stop), and save a
        checkpoint that is due."""
        settings, state = self.settings, self.state
        due = settings.checkpoint_every is not None and (
            state.step % settings.checkpoint_every == 0
        )
        local = settings.local_checkpoint_every  # the frequent tier's, where not persistent
        local = local is not None and not due and state.step % local == 0
        evaluating = self.evaluate is not None and state.step % self.evaluate[0] == 0
        aside = evaluating or due or local  # work that is no step, watched from its start:
        if aside:  # a beat removed here hid a worker stalled after the last save
            heartbeat.beat(state.step)  # (an evaluation compiles its own step first)
        if len(self.pending) == settings.log_every or due or local or evaluating:
            self.flush(evaluating)
            stop.agree()  # at the same step in every process
        if due or local:
            self.checkpoints.save(state, local=local)
            self.started = time.perf_counter()  # saving is not a step
        if aside:
            heartbeat.beat(state.step)  # and from its end

    def flush(self, evaluating: bool = False) -> None:
        """Read the pending steps' metrics into rows (with the evaluation's on the last, when
        ``evaluating``), and skip or stop at a non-finite step as ``on_nonfinite`` says."""
        settings, state, pending = self.settings, self.state, self.pending
        new = _rows(
            settings, self.mesh, state, self.program, pending, state.step - len(pending),
            self.started,
        )  # fmt: skip
        pending.clear()
        if evaluating:
            new[-1].update({f"eval_{k}": v for k, v in self.evaluate[1]().items()})
        faults = [
            row.pop(NONFINITE) > 0 if NONFINITE in row else not math.isfinite(row["loss"])
            for row in new
        ]
        if settings.on_nonfinite == "skip":
            for row, fault in zip(new, faults, strict=True):
                row["skipped"] = float(fault)
            state.skipped += sum(faults)
        elif True in faults:
            new = new[: faults.index(True) + 1]  # nothing after the fault
        self.rows.extend(new)
        state.history.extend(new)
        if self.callback is not None:
            self.callback(new)
        if settings.on_nonfinite == "stop" and True in faults:
            raise NonFiniteError.at(int(new[-1]["step"]), self.last())
        self.started = time.perf_counter()

    def finish(self, stop: StopSignals) -> None:
        """The ending of a run that was not stopped by an error: read the steps not yet read,
        agree on a stop, and save the last step where it is not saved yet."""
        if self.pending:
            self.flush()  # the last steps in flight, watched: a hang in them is a stall
        heartbeat.beat(self.state.step)  # as is one in the agreement on a stop,
        stop.agree()
        heartbeat.end()  # but not the last save
        checkpoints = self.checkpoints  # the last step saved, and into the persistent tier
        if checkpoints is not None and (self.state.saved_step != self.state.step
                                        or checkpoints.saved_in is not checkpoints.store):
            checkpoints.save(self.state)

    def interrupted(self, signum: int) -> TrainingInterrupted:
        """The error that says a signal stopped the run, and where it was saved."""
        name = signal.Signals(signum).name
        path = self.last()
        return TrainingInterrupted(
            f"stopped by {name} after step {self.state.step}; saved {path}: continue with "
            f"restore() (--resume)",
            signal=signum,
            step=self.state.step,
            checkpoint=path,
        )

    def last(self) -> str | None:
        """The path of the last checkpoint saved (None without checkpoints)."""
        return None if self.checkpoints is None else self.checkpoints.last(self.state)


def _rows(
    settings: Any,
    mesh: Any,
    state: RunState,
    program: Program,
    pending: list[dict[str, jax.Array]],
    first: int,
    started: float,
) -> list[dict[str, float]]:
    values = jax.device_get(pending)  # the loop's only wait on the devices
    step_time = (time.perf_counter() - started) / len(values)
    samples = feed.batch_rows(program.signature) * jax.process_count()
    rate = samples / step_time if step_time > 0 else math.inf
    if state.facts is None or state.facts[0] is not program:
        state.facts = (program, StepFacts.of(program, int(mesh.size)))
    hardware = device_rows(
        state.facts[1], step_time, rate, devices=list(mesh.devices.flat),
        flops_per_sample=settings.flops_per_sample,
        peak=settings.peak_tflops or peak_tflops(mesh.devices.flat[0]),
    )  # fmt: skip
    rows = []
    for k, metrics in enumerate(values):
        row = {"step": first + k, **{name: float(v) for name, v in metrics.items()}}
        row["step_time"] = step_time
        row["samples_per_sec"] = rate
        row.update(hardware)
        rows.append(row)
    return rows


def say_devices(strategy: str, mesh: Any, precision: str, reason: str) -> None:
    """The run's first line (standard error, process 0): how many devices it uses and why,
    so that one CPU device is never a surprise."""
    if jax.process_index() != 0:
        return
    count = mesh.size
    platform, there = mesh.devices.flat[0].platform, len(jax.devices())
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    where = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    if count < there:
        why = f"{count} of the {there} JAX has, as asked"
    elif count == 1 and platform == "cpu":
        why = ("the one device JAX has; shardplug.simulate_cpu_devices(8), called before "
               "JAX makes an array, gives 8 simulated CPU devices")  # fmt: skip
    else:
        why = "every device JAX has"
    plural = "s" if count != 1 else ""
    compute = ("bf16 compute, float32 parameters and optimizer state"
               if precision in ("bf16", "bfloat16") else "float32")  # fmt: skip
    print(f"shardplug: {strategy} on {count} {platform} device{plural}{processes} ({where}): "
          f"{why}; {compute} ({reason})", file=sys.stderr, flush=True)  # fmt: skip
