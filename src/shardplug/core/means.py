"""A loss given as a sum and a count, so that wherever the step cuts the batch (microbatches,
pipeline stages, devices of a per-device program) the parts' sums and counts are added
before the one division.

A loss averaged over rows (``jnp.mean``) is the mean of its parts' means when the parts have
as many rows each, which the step guarantees. A loss weighted by tokens,
``sum(ce * w) / sum(w)`` (masked and padded language models), is not: each part has its own
count. Such a loss returns :class:`Mean` and the step weighs each part's mean by its count.

Inside the step a declared count travels as a metric named :func:`weight_key` of what it
weighs (the loss, or a metric returned as a :class:`Mean` too); :func:`part_sums` and
:func:`combine` add parts up, :func:`reweigh` does it where a collective averages the parts
(a per-device program's ``pmean``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardplug.errors import ConfigError, warn_once

#: the prefix of the metrics that carry a declared count through the step (never reported)
WEIGHT = "_count"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
    """A mean given as its sum and its count: what a loss weighted by tokens returns.

    ::

        def loss_fn(model, batch):
            ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
            w = batch["mask"]
            return shardplug.Mean(jnp.sum(ce * w), jnp.sum(w))

    The loss is ``total / count``, and wherever the step cuts the batch (``grad_accum``,
    a pipeline's microbatches, a per-device program's devices) the parts' totals and counts are
    summed before the one division, so the loss and its gradient are the whole batch's, as
    one device computes them. ``count`` is data, not a function of the parameters: no
    gradient flows through it. A part (or a batch) whose count is 0 adds nothing; a batch
    with none at all has loss 0. A metric may be a :class:`Mean` too, with its own count.
    """

    total: Any
    count: Any


def weight_key(name: str | None = None) -> str:
    """The metric that carries the count of the loss (``name`` None) or of metric ``name``."""
    return WEIGHT if name is None else f"{WEIGHT}:{name}"


def declared(name: str, value: Any) -> tuple[jax.Array, jax.Array]:
    """``(total / count, count)`` of a :class:`Mean` named ``name`` (the loss or a metric);
    ``count`` float32 and without gradient, the division safe where it is 0."""
    for what in ("total", "count"):
        part = getattr(value, what)
        if not hasattr(part, "dtype") and (isinstance(part, bool)
                                           or not isinstance(part, int | float)):  # fmt: skip
            raise ConfigError(f"{name} is a shardplug.Mean whose {what} is {part!r}: give a "
                              "number or a scalar array (the sum over the batch, and how "
                              "many it sums)")  # fmt: skip
    count = jax.lax.stop_gradient(jnp.asarray(value.count)).astype(jnp.float32)
    total = jnp.asarray(value.total)
    if jnp.issubdtype(total.dtype, jnp.floating):  # a bfloat16 total: summed and divided in f32
        total = total.astype(jnp.promote_types(total.dtype, jnp.float32))
    for what, x in (("total", total), ("count", count)):
        if jnp.shape(x) != ():
            raise _shape_error(name, what, jnp.shape(x))
    return total / _safe(count).astype(total.dtype), count


def _shape_error(name: str, what: str, shape: tuple[int, ...]) -> Exception:
    return ConfigError(
        f"{name} is a shardplug.Mean whose {what} has shape {shape}: give its total and "
        "count as scalars (sum them over the batch)"
    )


def weighted(metrics: Mapping[str, Any]) -> bool:
    """Whether the loss or any metric declared a count."""
    return any(k.startswith(WEIGHT) for k in metrics)


def reported(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics without the counts that travel with them."""
    return {k: v for k, v in metrics.items() if not k.startswith(WEIGHT)}


def _counts(loss: Any, metrics: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each declared value and its count, by the key that carries the count."""
    out = {}
    for key, count in metrics.items():
        if key == WEIGHT:
            out[key] = (loss, count)
        elif key.startswith(WEIGHT + ":"):
            out[key] = (metrics[key[len(WEIGHT) + 1 :]], count)
    return out


def part_sums(loss: Any, metrics: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """One part's loss and metrics as sums: each declared value times its count (what parts
    add up); undeclared metrics as they are (averaged over the parts by :func:`combine`)."""
    metrics = dict(metrics)
    for key, (value, count) in _counts(loss, metrics).items():
        if key == WEIGHT:
            loss = loss * count.astype(loss.dtype)
        else:
            name = key[len(WEIGHT) + 1 :]
            metrics[name] = value * count.astype(value.dtype)
    return loss, metrics


def combine(loss_sum: Any, metric_sums: Mapping[str, Any], parts: int) -> tuple[Any, dict]:
    """The whole's loss and metrics from the parts' :func:`part_sums` added up over ``parts``
    parts: each declared value divided by its summed count, the rest by ``parts``."""
    metrics = dict(metric_sums)
    for key in list(metrics):
        if key.startswith(WEIGHT):
            continue
        count = metrics.get(weight_key(key))
        metrics[key] = metrics[key] / (parts if count is None else _safe(count))
    count = metrics.get(WEIGHT)
    loss = loss_sum / (parts if count is None else _safe(count))
    return loss, metrics


def grad_scale(metrics: Mapping[str, Any]) -> Any:
    """A part's gradient factor under a declared loss: its count (None: undeclared)."""
    return metrics.get(WEIGHT)


def divided(grad_sums: Any, metrics: Mapping[str, Any], parts: int) -> Any:
    """The whole's gradient from its parts' added up: over the loss's summed count (the
    metrics :func:`combine` gives), or over ``parts`` for an undeclared loss."""
    count = metrics.get(WEIGHT)
    if count is None:
        return jax.tree.map(lambda g: g / parts, grad_sums)
    return jax.tree.map(lambda g: g / _safe(count).astype(g.dtype), grad_sums)


def _safe(count: Any) -> Any:
    """``count`` with 0 as 1 (whose total is 0 too), for numpy and JAX values alike."""
    return count + (count == 0)


def reweigh(loss: Any, metrics: Mapping[str, Any], grads: Any, axis: Any) -> tuple:
    """A part's loss, metrics and gradient in a program whose parts are then averaged over
    ``axis`` (a per-device program's ``pmean``): each declared value scaled by its count over
    the parts' mean count, so that the average is the count-weighted one. The counts become
    their sums over ``axis``."""
    metrics = dict(metrics)
    counts = _counts(loss, metrics)
    for key, (value, count) in counts.items():
        mean = jax.lax.pmean(count, axis)
        factor = count / _safe(mean)
        if key == WEIGHT:
            loss = loss * factor.astype(loss.dtype)
            grads = jax.tree.map(lambda g, f=factor: g * f.astype(g.dtype), grads)
        else:
            name = key[len(WEIGHT) + 1 :]
            metrics[name] = value * factor.astype(value.dtype)
        metrics[key] = jax.lax.psum(count, axis)
    return loss, metrics, grads


#: whether the loss being traced divides by a count taken from the batch (:func:`normalised`)
_NORMALISED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardplug_loss_normalised_by_data", default=False
)


@contextlib.contextmanager
def normalised(by_data: bool) -> Iterator[None]:
    """Trace the step inside knowing whether its (undeclared) loss divides by a count taken
    from the batch (:func:`divides_by_data` of its traced forward pass)."""
    token = _NORMALISED.set(by_data)
    try:
        yield
    finally:
        _NORMALISED.reset(token)


def part_means(where: str) -> None:
    """Called where the step averages the means of its parts (``where`` says which:
    microbatches, devices, batch shards) of an undeclared loss: said once where that loss
    divides by a count taken from the batch, with how such a loss is declared instead."""
    if not _NORMALISED.get():
        return
    warn_once(
        f"the loss divides by a count taken from the batch, and the step's loss is the mean of "
        f"its parts' own losses ({where}): not the whole batch's; return "
        "shardplug.Mean(sum(l * w), sum(w)) from the loss to have the sums and counts added "
        "before the one division",
        stacklevel=3,
    )


def divides_by_data(jaxpr: Any, batch: int) -> bool:
    """Whether a traced loss (``jaxpr``: its last ``batch`` inputs the batch's leaves, those
    before them the parameters and model state) divides by a scalar computed from the batch
    alone (``sum(ce * w) / sum(w)``): a normaliser that differs between parts of the batch,
    where the mean of the parts' means is not the whole's. A row mean divides by a constant."""
    cut = len(jaxpr.invars) - batch
    return _divides_by_data(jaxpr, set(jaxpr.invars[:cut]), set(jaxpr.invars[cut:]))


def _divides_by_data(jaxpr: Any, from_params: set, from_batch: set) -> bool:
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not hasattr(v, "val")]  # literals hold a value
        divisor = eqn.invars[1] if eqn.primitive.name == "div" else None
        if divisor in ins and divisor in from_batch and divisor not in from_params \
                and not divisor.aval.shape:  # fmt: skip
            return True
        if any(_divides_by_data(body, *_entering(eqn, body, from_params, from_batch))
               for body in _bodies(eqn)):  # fmt: skip
            return True
        if any(v in from_params for v in ins):
            from_params.update(eqn.outvars)
        if any(v in from_batch for v in ins):
            from_batch.update(eqn.outvars)
    return False


def _bodies(eqn: Any) -> list[Any]:
    """The functions an equation calls (pjit, checkpoint, custom_vjp, scan, cond's branches)."""
    found = [v for value in eqn.params.values()
             for v in (value if isinstance(value, tuple) else (value,))]  # fmt: skip
    bodies = [getattr(v, "jaxpr", v) for v in found]
    return [b for b in bodies if hasattr(b, "eqns") and len(b.invars) <= len(eqn.invars)]


def _entering(eqn: Any, body: Any, from_params: set, from_batch: set) -> tuple[set, set]:
    """Which of ``body``'s inputs come from the parameters and which from the batch: its
    inputs are the equation's last ones (a cond's operands follow its branch index)."""
    given = eqn.invars[len(eqn.invars) - len(body.invars) :]
    pairs = [(a, b) for a, b in zip(given, body.invars, strict=True) if not hasattr(a, "val")]
    return {b for a, b in pairs if a in from_params}, {b for a, b in pairs if a in from_batch}
