"""A pipeline schedule's record, for a package that writes one: its passes, its table and
its name (``shardplug.plugin`` re-exports them).

A layer stack of L layers is cut into C = V*S *chunks* of L/C consecutive layers; chunk
``c`` lives on stage ``c % S`` as its local chunk ``c // S`` (with V > 1 each stage holds V
non-adjacent chunks, the circular layout of interleaved 1F1B). Each chunk runs three passes
on each of the M microbatches, one tick each (their matrix products are about equal: the
forward's, the input gradient's and the weight gradient's):

- ``F`` the forward pass, its residuals kept; the output goes to the next chunk's stage (the
  last chunk's to the loss, whose gradient comes back to it at the next tick);
- ``B`` the input gradient, sent to the previous chunk's stage (the first chunk's to the
  embeddings); what the weight gradient needs of it is kept (the *stash*);
- ``W`` the weight gradient, which nothing waits for; the residuals and stash are freed.

A schedule is one ordered list of passes per stage; :func:`tabulate` runs the lists tick by
tick, each pass at the first tick its inputs are there (a message sent at one tick is read at
the next), and numbers the buffers each stage keeps. The :class:`Table` it returns is what
pp's tick loop runs and what explain reports: its idle ticks are the bubble, its live
residuals the activation memory. pp's built-in schedules (1F1B, interleaved 1F1B, ZB-H1)
and the registry that finds one by name are in :mod:`shardplug.strategies.pp.schedules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from shardplug.errors import ConfigError

__all__ = ["BUFFERS", "KINDS", "Pass", "Schedule", "Table", "Unscheduled", "tabulate"]


class Unscheduled(ConfigError):
    """What a schedule that writes the backward pass in cannot run and GPipe can (a model
    that updates its state from the batch, two layer stacks, gradient accumulation): one
    line, or, under pp's ``auto`` schedule, GPipe instead."""


#: pass kinds, as the table codes them
IDLE, F, B, W = 0, 1, 2, 3
KINDS = {"F": F, "B": B, "W": W}

#: one pass: ``(kind, chunk, microbatch)``, kind "F", "B" or "W", chunk in 0..C-1
Pass = tuple[str, int, int]

#: the buffers a stage keeps, by what they hold and from when to when: a chunk's residuals
#: (its F to its W), a forward message (its arrival to its F), an output gradient (its
#: arrival to its B) and the stash (B to W)
BUFFERS = ("residual", "inbox", "grad", "stash")


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule tick by tick: ``(ticks, stages)`` integer arrays, -1 where unused.

    ``kind`` (IDLE, F, B, W), ``chunk`` (the stage's local chunk), ``micro`` (microbatch);
    the slot of each buffer a pass reads or writes (``residual``, ``inbox``, ``grad``,
    ``stash``); and the slot a message arriving at that tick is stored in: from the stage
    before (``recv_forward``, into ``inbox``), from the stage after (``recv_backward``, into
    ``grad``), the loss's gradient for the last chunk (``recv_loss``, into ``grad``)."""

    name: str
    stages: int
    chunks: int  # per stage (V)
    microbatches: int
    kind: np.ndarray
    chunk: np.ndarray
    micro: np.ndarray
    residual: np.ndarray
    inbox: np.ndarray
    grad: np.ndarray
    stash: np.ndarray
    recv_forward: np.ndarray
    recv_backward: np.ndarray
    recv_loss: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.kind.shape[0])

    @property
    def slots(self) -> dict[str, int]:
        """How many of each buffer a stage keeps (the most over the stages; at least 1)."""
        counts = {
            "residual": self.residual.max(),
            "stash": self.stash.max(),
            "inbox": max(self.inbox.max(), self.recv_forward.max()),
            "grad": max(self.grad.max(), self.recv_backward.max(), self.recv_loss.max()),
        }
        return {k: int(v) + 1 if v >= 0 else 1 for k, v in counts.items()}

    @property
    def idle(self) -> np.ndarray:
        """Each stage's idle ticks."""
        return (self.kind == IDLE).sum(axis=0)

    @property
    def bubble(self) -> float:
        """The idle share of the stages' ticks (the mean over the stages)."""
        return float(self.idle.mean() / self.ticks)

    @property
    def peak(self) -> list[float]:
        """Each stage's most microbatches' residuals held at once, in whole stages (a chunk
        counts 1/V): the activation memory the schedule promises."""
        live = np.zeros(self.stages)
        peak = np.zeros(self.stages)
        for t in range(self.ticks):
            live += self.kind[t] == F
            peak = np.maximum(peak, live)
            live -= self.kind[t] == W
        return (peak / self.chunks).tolist()

    def chart(self) -> str:
        """The table as text, a row per stage: ``F3`` is microbatch 3's forward (a letter
        per chunk for V > 1: ``F3a``, ``F3b``), ``.`` an idle tick."""
        letters = "abcdefghijklmnopqrstuvwxyz"
        cells = [
            [
                "."
                if self.kind[t, s] == IDLE
                else f"{'.FBW'[self.kind[t, s]]}"
                f"{self.micro[t, s]}{letters[self.chunk[t, s]] if self.chunks > 1 else ''}"
                for t in range(self.ticks)
            ]
            for s in range(self.stages)
        ]
        width = max(len(c) for row in cells for c in row)
        return "\n".join(" ".join(f"{c:<{width}}" for c in row).rstrip() for row in cells)


def tabulate(name: str, lists: Sequence[Sequence[Pass]], chunks: int = 1,
             fused: bool = False) -> Table:  # fmt: skip
    """Run each stage's passes in order, each at the first tick it can (see the module), and
    number the buffers. With ``fused`` a chunk's input gradient is read by the stage before
    only after the chunk's W too (a backward pass of two ticks, as 1F1B's).

    Refuses, in one line, lists that are not a schedule: a pass missing or repeated, a pass
    on the wrong stage, or an order in which some pass waits forever."""
    n_stages = len(lists)
    n_chunks = n_stages * chunks
    passes = [p for seq in lists for p in seq]
    n_micro = 1 + max((m for _, _, m in passes), default=-1)
    want = {(k, c, m) for k in "FBW" for c in range(n_chunks) for m in range(n_micro)}
    if len(passes) != len(set(passes)) or set(passes) != want:
        raise ConfigError(
            f"pipeline schedule {name!r} must run F, B and W of each of the {n_chunks} chunks on "
            f"each microbatch exactly once"
        )
    for d, seq in enumerate(lists):
        if any(c % n_stages != d for _, c, _ in seq):
            raise ConfigError(
                f"pipeline schedule {name!r} runs a chunk on stage {d} that lives on another "
                f"(chunk c lives on stage c % {n_stages})"
            )
    done: dict[Pass, int] = {}
    at = [0] * n_stages
    rows: list[list[Pass | None]] = []
    while any(at[d] < len(lists[d]) for d in range(n_stages)):
        t = len(rows)
        row: list[Pass | None] = []
        for d in range(n_stages):
            if at[d] >= len(lists[d]):
                row.append(None)
                continue
            kind, c, m = lists[d][at[d]]
            if kind == "F":
                needs = [("F", c - 1, m)] if c > 0 else []
            elif kind == "B":
                needs = [("F", c, m)] + (
                    [("W" if fused else "B", c + 1, m)] if c < n_chunks - 1 else []
                )
            else:
                needs = [("B", c, m)]
            ready = all(done.get(p, t) < t for p in needs)  # each done at an earlier tick
            row.append((kind, c, m) if ready else None)
        for d, action in enumerate(row):
            if action is not None:
                done[action] = t
                at[d] += 1
        rows.append(row)
        if not any(row):  # nothing ran, so nothing will: every earlier pass is before t + 1
            raise ConfigError(f"pipeline schedule {name!r} never finishes: a pass waits forever")
    return _numbered(name, rows, n_stages, chunks, n_micro, done)


def _numbered(
    name: str, rows: list, n_stages: int, n_local: int, n_micro: int, done: dict
) -> Table:
    """The table of ``rows``, each stage's buffers numbered: a slot is taken when its
    contents arrive (residuals at the F, the stash at the B) and free again at the tick
    after the pass that last reads it."""
    n_ticks, n_chunks = len(rows), n_stages * n_local
    fields = ("kind", "chunk", "micro", *BUFFERS, "recv_forward", "recv_backward", "recv_loss")
    arrays = {k: np.full((n_ticks, n_stages), -1, np.int32) for k in fields}
    arrays["kind"][:] = IDLE
    free: dict[str, list[list[int]]] = {k: [[] for _ in range(n_stages)] for k in BUFFERS}
    count = {k: [0] * n_stages for k in BUFFERS}
    held: dict[tuple, int] = {}

    def take(kind: str, d: int, key: tuple) -> int:
        pool = free[kind][d]
        slot = pool.pop(0) if pool else count[kind][d]
        count[kind][d] = max(count[kind][d], slot + 1)
        held[(kind, *key)] = slot
        return slot

    for t, row in enumerate(rows):
        releases = []
        prev = rows[t - 1] if t else [None] * n_stages
        for d in range(n_stages):  # what was sent at t-1 arrives at t
            sent = prev[(d - 1) % n_stages]
            if sent and sent[0] == "F" and sent[1] + 1 < n_chunks:
                arrays["recv_forward"][t, d] = take("inbox", d, (sent[1] + 1, sent[2]))
            sent = prev[(d + 1) % n_stages]
            if sent and sent[0] == "B" and sent[1] > 0:
                arrays["recv_backward"][t, d] = take("grad", d, (sent[1] - 1, sent[2]))
            sent = prev[d]
            if sent and sent[0] == "F" and sent[1] == n_chunks - 1:  # the loss's gradient
                arrays["recv_loss"][t, d] = take("grad", d, (sent[1], sent[2]))
        for d, action in enumerate(row):
            if action is None:
                continue
            kind, c, m = action
            arrays["kind"][t, d] = KINDS[kind]
            arrays["chunk"][t, d] = c // n_stages
            arrays["micro"][t, d] = m
            if kind == "F":
                if c > 0:
                    arrays["inbox"][t, d] = held[("inbox", c, m)]
                    releases.append(("inbox", d, (c, m)))
                arrays["residual"][t, d] = take("residual", d, (c, m))
            elif kind == "B":
                arrays["residual"][t, d] = held[("residual", c, m)]
                arrays["grad"][t, d] = held[("grad", c, m)]
                arrays["stash"][t, d] = take("stash", d, (c, m))
                releases.append(("grad", d, (c, m)))
            else:
                arrays["residual"][t, d] = held[("residual", c, m)]
                arrays["stash"][t, d] = held[("stash", c, m)]
                releases += [("residual", d, (c, m)), ("stash", d, (c, m))]
        for kind, d, key in releases:  # free from the next tick
            free[kind][d].append(held.pop((kind, *key)))
            free[kind][d].sort()
    return Table(name, n_stages, n_local, n_micro, **arrays)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule by name: each stage's passes for S stages, M microbatches and V
    chunks per stage (``passes(S, M, V)``), whether a chunk's input gradient waits for its
    W (``fused``), and the bubble its authors promise (``formula(S, M, V)``).

    A plugin adds one by giving :class:`shardplug.strategies.pp.PipelineParallel` (``pp``) a
    ``Schedule`` as its ``schedule`` option, or by registering it under the entry-point
    group ``shardplug.schedules`` so ``-o pp.schedule=NAME`` finds it."""

    name: str
    passes: Callable[[int, int, int], Sequence[Sequence[Pass]]]
    formula: Callable[[int, int, int], float]
    fused: bool = False
    chunked: bool = False  # runs V > 1 chunks per stage (``repeats``)
    description: str = ""

    def table(self, stages: int, microbatches: int, chunks: int = 1) -> Table:
        """The schedule's :class:`Table`."""
        return tabulate(self.name, self.passes(stages, microbatches, chunks), chunks,
                        fused=self.fused)  # fmt: skip
