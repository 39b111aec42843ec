"""``Trainer.evaluate``: the mean loss and metrics over held-out batches."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplug.core.means import combine, part_sums, reported
from shardplug.errors import ConfigError
from shardplug.loop import feed
from shardplug.loop.program import Program, RunState

#: the most batches an evaluation reads from a source without a length when no ``steps``
#: (``eval_steps``) bound it: an endless one would hang, so the cap is said in the result
EVAL_CAP = 1000


def check_eval(eval_data: Any, eval_every: int | None) -> None:
    """Refuse evaluation settings that cannot work, before training starts."""
    if (eval_data is None) != (eval_every is None):
        raise ConfigError("eval_data and eval_every go together: give both or neither")
    if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
        raise ConfigError(f"eval_every must be a positive integer, got {eval_every!r}")
    if one_shot(eval_data):
        raise ConfigError(ONE_SHOT)


def periodic(eval_data: Any, eval_every: int | None, eval_steps: int | None,
             evaluate: Callable[..., dict[str, float]]) -> tuple[int, Callable] | None:  # fmt: skip
    """``(every, run)`` for the loop: ``evaluate`` on a fresh read of ``eval_data`` (a
    function is called again) every ``eval_every`` steps, checked now; None without."""
    check_eval(eval_data, eval_every)
    if eval_every is None:
        return None
    fresh = eval_data if callable(eval_data) else lambda: eval_data
    return eval_every, lambda: evaluate(fresh(), steps=eval_steps)


ONE_SHOT = (
    "eval_data is a one-shot iterator (a generator?), used up by the first evaluation: pass "
    "a list, a shardplug.running.data.Batches, or a function returning a fresh iterable (with "
    "eval_steps if it is endless)"
)


def _has_length(batches: Any) -> bool:
    try:
        len(batches)
    except TypeError:
        return False
    return True


def one_shot(data: Any) -> bool:
    """Whether ``data`` is an iterator, which can be read only once."""
    return data is not None and not callable(data) and iter(data) is data


def evaluate(
    state: RunState,
    program_for: Callable[[Any], Program],
    batches: Iterable[Any],
    steps: int | None,
) -> dict[str, float]:
    """The mean loss and metrics over ``batches``, the model in evaluation mode
    (:meth:`shardplug.Trainer.evaluate`).

    Nothing is updated: no optimizer step, and batch statistics are read, not written
    (dropout off, BatchNorm on its running averages). ``steps`` bounds how many batches are
    read; without it a source with no length is read to at most :data:`EVAL_CAP` batches,
    and the result's ``batches`` says so when the cap stopped it. ``program_for(batch)`` is
    the evaluation step (compiled once, on the first batch); it reads the state and gives it
    back unchanged (the step donates it, so ``state.leaves`` is replaced by what it
    returns)."""
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be a positive integer or None, got {steps!r}")
    totals: dict[str, jax.Array] | None = None
    count = 0
    capped = steps is None and not _has_length(batches)
    if capped:
        steps = EVAL_CAP
    for batch in batches if steps is None else itertools.islice(batches, steps):
        program = program_for(batch)
        feed.check(batch, count, program.signature)
        state.leaves, metrics = program.compiled(
            state.leaves, feed.put(batch, program.batch_shardings)
        )
        loss, metrics = part_sums(metrics["loss"], metrics)  # a declared loss's sums
        metrics = {**metrics, "loss": loss}
        totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
        count += 1
    if totals is None:
        raise ConfigError("evaluate got no batches: the evaluation data is empty (or used up)")
    totals = {k: np.asarray(v, np.float64) for k, v in jax.device_get(totals).items()}
    loss, metrics = combine(totals.pop("loss"), totals, count)
    means = {name: float(value) for name, value in {"loss": loss, **reported(metrics)}.items()}
    return {**means, "batches": float(count)} if capped and count == EVAL_CAP else means
