"""pp's built-in pipeline schedules, each stage's passes (F, B, W) in order, and the registry
that finds a schedule by name (the built-ins, then those packages register under
:data:`GROUP`).

A schedule's record, its passes and its table (:class:`~shardplug.plugin.Schedule`,
:func:`~shardplug.plugin.tabulate`, :class:`~shardplug.plugin.Table`) are
:mod:`shardplug.plugin.schedule`'s, public for a package that writes one; the tick loop that
runs a table is :func:`shardplug.strategies.pp.ticks.scheduled_grads`.

Bubbles, in ticks (F = B = W):

- 1F1B (Narayanan et al., 2021; V = 1): after S-s-1 warm-up forwards stage ``s``
  alternates one F and one backward (B, then W); a chunk's input gradient leaves after its
  W, as a fused backward's does. Bubble (S-1)/(M+S-1), as GPipe's, with at most S
  microbatches' residuals on a stage instead of M.
- interleaved 1F1B (V > 1 chunks per stage, M a multiple of S): bubble (S-1)/(V*M+S-1), a
  little more memory than 1F1B.
- ZB-H1 (Qi et al., 2023): 1F1B with each input gradient sent as soon as B is done and stage
  ``s``'s W passes put off by ``s`` microbatches, into what would be idle: bubble
  (S-1)/(3M+S-1), at 1F1B's peak of S microbatches.
- ZB-V (Qi et al., 2024, section 6): two chunks per stage placed in a V (chunk ``s`` and
  chunk ``2S-1-s`` on stage ``s``), so the last chunk's loss gradient starts the backward
  pass on stage 0, where the forward pass began, and ZB-H1's put-off W passes fill the
  rest: bubble (S-1)/(6M+S-1) in ticks of one chunk's pass, with M of about 3S/2 and more
  (with fewer, d/(6M+d) for d = 2(2S-1-M) idle ticks), at 1F1B's peak of S microbatches.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from collections.abc import Callable

from shardplug.plugin import (
    Pass,
    Schedule,
    ShardplugWarning,
    StrategyOptionError,
    Table,
    Unscheduled,
    tabulate,
    v_shape,
)

__all__ = ["GROUP", "SCHEDULES", "Pass", "Schedule", "Table", "Unscheduled", "find_schedule",
           "installed", "one_f_one_b", "sources", "tabulate", "zero_bubble",
           "zero_bubble_v"]  # fmt: skip


def one_f_one_b(stages: int, microbatches: int, chunks: int = 1) -> list[list[Pass]]:
    """Each stage's passes under 1F1B (``chunks`` = 1) or interleaved 1F1B (Narayanan et
    al., 2021): warm-up forwards, then one F and one backward (B, W) in turn, then the
    remaining backwards. With V chunks per stage the microbatches go through the chunks in
    rounds of S (``microbatches`` a multiple of ``stages``)."""
    return _lists(stages, microbatches, chunks, defer=None)


def zero_bubble(stages: int, microbatches: int) -> list[list[Pass]]:
    """Each stage's passes under ZB-H1: 1F1B's order with stage ``s``'s W passes put off by
    ``s`` microbatches (the rest at the end)."""
    return _lists(stages, microbatches, 1, defer=lambda s: s)


def zero_bubble_v(stages: int, microbatches: int) -> list[list[Pass]]:
    """Each stage's passes under ZB-V, chunks placed by :func:`~shardplug.plugin.v_shape`:
    stage ``s`` runs its first chunk's forwards ahead (more the earlier the stage), then
    its second chunk's F, B and W in turn as the loss's gradients come back, then both
    chunks' in turn, the last input gradients before the W passes they put off."""
    return [_v_stage(stages, s, microbatches) for s in range(stages)]


def _v_stage(stages: int, s: int, microbatches: int) -> list[Pass]:
    """Stage ``s``'s passes under ZB-V: its chunk on the way down is ``s``, on the way up
    ``2S-1-s``; the order is written for a full V of 2S-1 microbatches at least, those past
    M left out."""
    chunk = (s, 2 * stages - 1 - s)
    seq: list[Pass] = []
    count = {(k, leg): 0 for k in "FBW" for leg in (0, 1)}

    def run(kind: str, leg: int) -> None:
        seq.append((kind, chunk[leg], count[kind, leg]))
        count[kind, leg] += 1

    rounds = max(2 * stages - 1, microbatches)
    for _ in range(2 * (stages - s) - 1):
        run("F", 0)
    for _ in range(s):
        run("F", 1)
        run("F", 0)
    for _ in range(stages - s):
        for kind in "FBW":
            run(kind, 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < rounds:
        if count["F", 0] < rounds:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        for kind in "FBW":
            run(kind, 1)
    for _ in range(s):
        run("B", 0)
        run("B", 1)
    for _ in range(stages - s):
        run("B", 0)
        run("W", 0)
    for leg in (1, 0):
        while count["W", leg] < count["B", leg]:
            run("W", leg)
    return [p for p in seq if p[2] < microbatches]


def _v_idle(stages: int, microbatches: int) -> int:
    """A stage's idle ticks under ZB-V: S-1, as ZB-H1's, once the V is full (M of about 3S/2
    and more); with fewer microbatches the stages wait 2(2S-1-M) ticks for each other."""
    return max(stages - 1, 2 * (2 * stages - 1 - microbatches))


def _lists(
    n_stages: int, n_micro: int, n_local: int, defer: Callable[[int], int] | None
) -> list[list[Pass]]:
    n_chunks = n_stages * n_local
    lists = []
    for stage in range(n_stages):
        mine = [(c, m) for c in range(stage, n_chunks, n_stages) for m in range(n_micro)]
        forwards = sorted(mine, key=lambda a: (a[1] // n_stages, a[0], a[1]))
        backwards = sorted(mine, key=lambda a: (a[1] // n_stages, -a[0], a[1]))
        warm = (
            n_stages - stage - 1
            if n_local == 1
            else 2 * (n_stages - stage - 1) + (n_local - 1) * n_stages
        )
        seq: list[Pass] = [("F", c, m) for c, m in forwards[:warm]]
        forwards = forwards[warm:]
        waiting: list[tuple[int, int]] = []
        while forwards or backwards:
            if forwards:
                seq.append(("F", *forwards.pop(0)))
            if backwards:
                c, m = backwards.pop(0)
                seq.append(("B", c, m))
                if defer is None:
                    seq.append(("W", c, m))
                else:
                    waiting.append((c, m))
            if waiting and (len(waiting) > defer(stage) or not forwards):
                seq.append(("W", *waiting.pop(0)))
        seq += [("W", c, m) for c, m in waiting]
        lists.append(seq)
    return lists


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "1f1b",
            lambda s, m, v: one_f_one_b(s, m),
            lambda s, m, v: (s - 1) / (m + s - 1),
            fused=True,
            description="one forward, one backward: GPipe's bubble, S microbatches' memory",
        ),
        Schedule(
            "interleaved-1f1b",
            lambda s, m, v: one_f_one_b(s, m, v),
            lambda s, m, v: (s - 1) / (v * m + s - 1),
            fused=True,
            chunked=True,
            description="1F1B over repeats=V chunks per stage: the bubble over V",
        ),
        Schedule(
            "zb",
            lambda s, m, v: zero_bubble(s, m),
            lambda s, m, v: (s - 1) / (3 * m + s - 1),
            description="zero-bubble ZB-H1: weight gradients put off into the bubble",
        ),
        Schedule(
            "zbv",
            lambda s, m, v: zero_bubble_v(s, m),
            lambda s, m, v: _v_idle(s, m) / (6 * m + _v_idle(s, m)),
            chunked=True,
            placement=v_shape,
            repeats=2,
            description="zero-bubble ZB-V: two chunks per stage placed in a V",
        ),
    )
}

#: the entry-point group a package registers a :class:`Schedule` under
GROUP = "shardplug.schedules"


@functools.cache
def installed() -> dict[str, Schedule]:
    """Every schedule by name: the built-ins, then those installed packages register under
    :data:`GROUP` (one that fails to load, or is not a Schedule, is skipped with a warning)."""
    found = dict(SCHEDULES)
    for entry in importlib.metadata.entry_points(group=GROUP):
        try:
            schedule = entry.load()
        except Exception as exc:  # a broken package must not break the built-ins
            warnings.warn(f"pipeline schedule {entry.name!r} cannot be loaded: {exc}",
                          ShardplugWarning, stacklevel=2)  # fmt: skip
            continue
        if not isinstance(schedule, Schedule) or entry.name in found:
            why = (
                "is not a shardplug.plugin.Schedule"
                if not isinstance(schedule, Schedule)
                else "is a name already taken"
            )
            warnings.warn(f"pipeline schedule {entry.name!r} {why}: skipped", ShardplugWarning,
                          stacklevel=2)  # fmt: skip
            continue
        found[entry.name] = schedule
    return found


def sources() -> dict[str, str]:
    """Where each installed schedule comes from: ``built-in``, or the package and version
    that registers it (``shardplug strategies`` lists them)."""
    named = {
        entry.name: f"{entry.dist.name} {entry.dist.version}" if entry.dist else entry.value
        for entry in importlib.metadata.entry_points(group=GROUP)
    }
    return {name: "built-in" if name in SCHEDULES else named[name] for name in installed()}


def find_schedule(schedule: str | Schedule) -> Schedule:
    """The :class:`Schedule` ``schedule`` names (or is), refused in one line if unknown."""
    if isinstance(schedule, Schedule):
        return schedule
    known = installed()
    if schedule == "gpipe":
        raise StrategyOptionError(
            "'gpipe' is pp's own schedule (every forward, then the backward pass JAX derives), "
            f"not a table of passes: the schedules that are ({', '.join(known)}) write the "
            "backward pass in"
        )
    if schedule not in known:
        raise StrategyOptionError(
            f"pp option schedule must be one of gpipe, {', '.join(known)}, got {schedule!r}"
        )
    return known[schedule]
