"""``Trainer.evaluate``: the mean loss and metrics over held-out batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from shardplug.core.step import make_eval_step
from shardplug.errors import ConfigError
from shardplug.loop import batches as host


def evaluate(trainer: Any, batches: Iterable[Any], steps: int | None) -> dict[str, float]:
    """See :meth:`shardplug.Trainer.evaluate`. The evaluation step is compiled once, on the
    first batch; it reads the state and writes it back unchanged (the step donates it)."""
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be a positive integer or None, got {steps!r}")
    if not trainer.allocated:
        raise ConfigError("this Trainer plans (allocate=False): it compiles, it does not evaluate")
    totals: dict[str, jax.Array] | None = None
    count = 0
    for batch in batches if steps is None else itertools.islice(batches, steps):
        if trainer._eval is None:
            fn = make_eval_step(trainer.adapter, trainer.loss_fn, trainer.strategy, trainer.mesh)
            trainer._eval = trainer._build(lambda _, fn=fn: fn, batch)
        host.check(batch, count, trainer._eval.signature)
        trainer._leaves, metrics = trainer._eval.compiled(
            trainer._leaves, host.put(batch, trainer._eval.batch_shardings)
        )
        totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
        count += 1
    if totals is None:
        raise ConfigError("evaluate got no batches")
    return {name: float(value) / count for name, value in jax.device_get(totals).items()}
