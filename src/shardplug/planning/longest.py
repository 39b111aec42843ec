"""The longest sequence each strategy fits in a device's memory, found by compiling the step
(nothing allocated) at ever longer sequences (``shardplug recommend --longest-sequence``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shardplug.errors import ShardplugError
from shardplug.planning.explain import explain


def longest_sequences(
    compile_at: Callable[[str, int, int | None], tuple[Any, Any]],
    device_memory: int,
    strategies: list[str],
    start: int,
    limit: int = 1 << 20,
    seconds: float | None = None,
) -> dict[str, Any]:
    """The longest sequence each of ``strategies`` fits in ``device_memory``, by compiling
    the step (nothing allocated) at ever longer sequences: doubling from ``start`` until the
    peak no longer fits, then halving the gap to within an eighth (and a quarter of
    ``start``). Each strategy is planned at one sequence per batch-splitting device (a global
    batch of the mesh's data-parallel degree): the longest a single sample can be.

    :param compile_at: ``(name, sequence, rows or None) -> (trainer, batch)``, the task at
        that sequence and global batch (None: the task's own).
    :param limit: the longest sequence tried (the model's positions, where it has a most).
    :param seconds: the time the search may take, over all the strategies (None: no end); a
        strategy's search stops where it runs out, its longest then "at least" what fit.
    :return: ``{"strategies": [row per strategy]}``; a row's ``longest`` is None when not
        even a quarter of ``start`` fits, and ``capped`` when it fit at ``limit``, the most
        tried (the longest is at least that), ``timed_out`` where the time ran out first;
        ``tried`` lists every ``[sequence, peak bytes]``.
    """
    import time

    ends = None if seconds is None else time.monotonic() + seconds
    rows = []
    for name in strategies:
        try:
            rows.append(_longest(compile_at, name, device_memory, start, limit, ends))
        except ShardplugError as exc:
            rows.append({"strategy": name, "error": str(exc)})
    return {"strategies": rows, "device_memory": device_memory, "limit": limit,
            "seconds": seconds}  # fmt: skip


class _OutOfTime(Exception):
    """The search's time ran out."""


def _longest(compile_at, name: str, device_memory: int, start: int, limit: int,
             ends: float | None = None) -> dict:  # fmt: skip
    import time

    import jax

    trainer, batch = compile_at(name, start, None)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    spec = jax.tree.leaves(trainer.strategy.shard_batch(abstract, trainer.mesh))[0].spec
    lead = spec[0] if len(spec) else None
    axes = () if lead is None else (lead,) if isinstance(lead, str) else tuple(lead)
    per_row = math.prod(trainer.mesh.shape[a] for a in axes)  # one sample per batch rank
    tried: dict[int, int] = {}

    def fits(length: int) -> bool:
        if length not in tried:
            if ends is not None and time.monotonic() > ends:
                raise _OutOfTime
            trainer, batch = compile_at(name, length, per_row)
            tried[length] = explain(trainer, batch, device_memory=device_memory).per_device[
                "peak_bytes"
            ]
        return tried[length] <= device_memory

    granule = max(start // 4, 1)
    low, high, timed_out = min(start, limit), None, False
    try:
        while fits(low) and low < limit:  # double while it fits, up to the limit
            low = min(low * 2, limit)
        if not fits(low):  # then halve until it does (when start itself did not)
            low, high = low // 2, low
            while low >= granule and not fits(low):
                low, high = low // 2, low
        while high is not None and low >= granule and high - low > max(granule, low // 8):
            middle = (low + high) // 2 // granule * granule
            low, high = (middle, high) if fits(middle) else (low, middle)
    except _OutOfTime:  # the longest that fit so far, at least
        timed_out = True
        fitted = [k for k, v in tried.items() if v <= device_memory]
        low = max(fitted) if fitted else 0
        over = [k for k, v in tried.items() if v > device_memory and k > low]
        high = min(over) if over else None
    longest = low if low >= granule else None
    capped = longest is not None and longest >= limit and high is None
    return {
        "timed_out": timed_out,  # the time ran out: the answer is at least what fit
        "capped": capped,  # it still fit at the most tried: the answer is at least that
        "strategy": name,
        "mesh": {str(k): int(v) for k, v in trainer.mesh.shape.items()},
        "rows": per_row,
        "longest": longest,
        "peak_bytes": tried.get(longest) if longest else None,
        "first_over": high,
        "tried": sorted([k, v] for k, v in tried.items()),
    }


__all__ = ["longest_sequences"]
