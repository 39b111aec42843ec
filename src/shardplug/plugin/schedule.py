"""A pipeline schedule's record, for a package that writes one: its passes, its table and
its name (``shardplug.plugin`` re-exports them).

A layer stack of L layers is cut into C = V*S *chunks* of L/C consecutive layers, each living
on one stage as a schedule's *placement* says: :func:`looped` (the default) puts chunk ``c``
on stage ``c % S``, the circular layout of interleaved 1F1B; :func:`v_shape` runs the
chunks down the stages and back up (chunk ``c`` on ``c`` for ``c < S``, then ``2S-1-c``: a
V, ZB-V's), so the first and the last chunk share stage 0 and the turn stays on stage S-1.
Each round of S consecutive chunks puts one on each stage (a stage's local chunk ``k`` is
the one of round ``k``), and consecutive chunks live on one stage or on neighbours of the
ring, which is what a message can travel in one tick. Each chunk runs three passes on each
of the M microbatches, one tick each (their matrix products are about equal: the
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
residuals the activation memory. pp's built-in schedules (1F1B, interleaved 1F1B, ZB-H1, ZB-V)
and the registry that finds one by name are in :mod:`shardplug.strategies.pp.schedules`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from shardplug.errors import ConfigError

__all__ = [
    "BUFFERS",
    "KINDS",
    "Pass",
    "Placement",
    "Schedule",
    "Table",
    "Unscheduled",
    "looped",
    "tabulate",
    "v_shape",
]


class Unscheduled(ConfigError):
    """What a schedule that writes the backward pass in cannot run and GPipe can (a model
    that updates its state from the batch, two layer stacks, gradient accumulation): one
    line, or, under pp's ``auto`` schedule, GPipe instead."""


#: pass kinds, as the table codes them
IDLE, F, B, W = 0, 1, 2, 3
KINDS = {"F": F, "B": B, "W": W}

#: one pass: ``(kind, chunk, microbatch)``, kind "F", "B" or "W", chunk in 0..C-1
Pass = tuple[str, int, int]

#: where each chunk lives: ``placement(S, V)``, the stage of each of the V*S chunks in order
Placement = Callable[[int, int], Sequence[int]]


def looped(stages: int, chunks: int) -> list[int]:
    """Chunk ``c`` on stage ``c % S``: down the stages V times (1F1B's, interleaved 1F1B's)."""
    return [c % stages for c in range(stages * chunks)]


def v_shape(stages: int, chunks: int) -> list[int]:
    """Down the stages and back up, V times over (a V for V = 2, ZB-V's): chunk ``c`` on
    stage ``c % S`` in an even round, ``S-1-c % S`` in an odd one."""
    return [
        c % stages if (c // stages) % 2 == 0 else stages - 1 - c % stages
        for c in range(stages * chunks)
    ]


#: the arrivals of messages that do not run round the ring one way (a V's)
RETURNING = ("recv_forward_after", "recv_backward_before", "recv_forward_self",
             "recv_backward_self")  # fmt: skip

#: the buffers a stage keeps, by what they hold and from when to when: a chunk's residuals
#: (its F to its W), a forward message (its arrival to its F), an output gradient (its
#: arrival to its B) and the stash (B to W)
BUFFERS = ("residual", "inbox", "grad", "stash")


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule tick by tick: ``(ticks, stages)`` integer arrays, -1 where unused.

    ``kind`` (IDLE, F, B, W), ``chunk`` (the stage's local chunk), ``micro`` (microbatch);
    the slot of each buffer a pass reads or writes (``residual``, ``inbox``, ``grad``,
    ``stash``); and the slot a message arriving at that tick is stored in. A stage sends one
    message a tick at most (its pass's output), round the ring to the stage after it, back
    to the stage before it, or to itself where two consecutive chunks share it (a V's turn):
    ``recv_forward`` (a forward message from the stage before, into ``inbox``),
    ``recv_backward`` (an input gradient from the stage after, into ``grad``), and where the
    chunks do not all run round the ring one way (a V's way back up) ``recv_forward_after``,
    ``recv_backward_before``, ``recv_forward_self`` and ``recv_backward_self``; the loss's
    gradient for the last chunk, ``recv_loss`` (into ``grad``). ``placement``: each chunk's
    stage."""

    name: str
    stages: int
    chunks: int  # per stage (V)
    microbatches: int
    placement: tuple[int, ...]
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
    recv_forward_after: np.ndarray
    recv_backward_before: np.ndarray
    recv_forward_self: np.ndarray
    recv_backward_self: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.kind.shape[0])

    @property
    def one_way(self) -> bool:
        """Whether every message runs round the ring one way (forward messages to the stage
        after, input gradients to the stage before): no V's way back, no turn."""
        return all((getattr(self, f) < 0).all() for f in RETURNING)

    @property
    def stage_chunks(self) -> list[list[int]]:
        """Each stage's chunks (their numbers in the model), in its local order."""
        return [[c for c, d in enumerate(self.placement) if d == s] for s in range(self.stages)]

    @property
    def model_chunk(self) -> np.ndarray:
        """The model's number of the chunk each pass runs, -1 where idle."""
        of = np.asarray(self.stage_chunks)  # (stages, V)
        at = np.broadcast_to(np.arange(self.stages)[None, :], self.chunk.shape)
        return np.where(self.kind != IDLE, of[at, np.maximum(self.chunk, 0)], -1)

    @property
    def sending(self) -> dict[str, np.ndarray]:
        """Per tick, whether some stage's message goes to the stage after it (``after``) or
        before it (``before``): the ring's sends."""
        after = np.zeros(self.ticks, bool)
        before = np.zeros(self.ticks, bool)
        after[:-1] = ((self.recv_forward >= 0) | (self.recv_backward_before >= 0)).any(1)[1:]
        before[:-1] = ((self.recv_backward >= 0) | (self.recv_forward_after >= 0)).any(1)[1:]
        return {"after": after, "before": before}

    @property
    def slots(self) -> dict[str, int]:
        """How many of each buffer a stage keeps (the most over the stages; at least 1)."""
        inbox = ("inbox", "recv_forward", "recv_forward_after", "recv_forward_self")
        grad = ("grad", "recv_backward", "recv_loss", "recv_backward_before",
                "recv_backward_self")  # fmt: skip
        counts = {
            "residual": self.residual.max(),
            "stash": self.stash.max(),
            "inbox": max(getattr(self, f).max() for f in inbox),
            "grad": max(getattr(self, f).max() for f in grad),
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
             fused: bool = False, placement: Placement = looped) -> Table:  # fmt: skip
    """Run each stage's passes in order, each at the first tick it can (see the module), and
    number the buffers. With ``fused`` a chunk's input gradient is read by the stage before
    only after the chunk's W too (a backward pass of two ticks, as 1F1B's).

    Refuses, in one line, lists that are not a schedule: a pass missing or repeated, a pass
    on the wrong stage, an order in which some pass waits forever, or a placement that does
    not put one of each S consecutive chunks on each stage, consecutive ones on one stage or
    neighbours."""
    n_stages = len(lists)
    n_chunks = n_stages * chunks
    where = _placed(name, placement, n_stages, chunks)
    passes = [p for seq in lists for p in seq]
    n_micro = 1 + max((m for _, _, m in passes), default=-1)
    want = {(k, c, m) for k in "FBW" for c in range(n_chunks) for m in range(n_micro)}
    if len(passes) != len(set(passes)) or set(passes) != want:
        raise ConfigError(
            f"pipeline schedule {name!r} must run F, B and W of each of the {n_chunks} chunks on "
            f"each microbatch exactly once"
        )
    for d, seq in enumerate(lists):
        if any(where[c] != d for _, c, _ in seq):
            c = next(c for _, c, _ in seq if where[c] != d)
            raise ConfigError(
                f"pipeline schedule {name!r} runs chunk {c} on stage {d}, and its placement "
                f"puts it on stage {where[c]}"
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
    return _numbered(name, rows, where, chunks, n_micro)


def _placed(name: str, placement: Placement, n_stages: int, n_local: int) -> tuple[int, ...]:
    """Each chunk's stage, refused in one line unless each round of S consecutive chunks puts
    one on each stage (a stage's local chunk ``k`` is of round ``k``) and a message goes from
    each chunk to the next in one tick (the same stage or a neighbour)."""
    where = tuple(int(d) for d in placement(n_stages, n_local))
    n_chunks = n_stages * n_local
    rounds = [sorted(where[r * n_stages : (r + 1) * n_stages]) for r in range(n_local)]
    if len(where) != n_chunks or any(r != list(range(n_stages)) for r in rounds):
        raise ConfigError(
            f"pipeline schedule {name!r} places its {n_chunks} chunks as {list(where)}: the "
            f"placement must put one of each {n_stages} consecutive chunks on each stage"
        )
    for c in range(n_chunks - 1):
        if (where[c + 1] - where[c]) % n_stages not in (0, 1, n_stages - 1):
            raise ConfigError(
                f"pipeline schedule {name!r} places chunk {c} on stage {where[c]} and chunk "
                f"{c + 1} on stage {where[c + 1]}: consecutive chunks must live on one stage "
                f"or on neighbours of the ring"
            )
    return where


def _arrival(kind: str, sender: int, receiver: int, n_stages: int) -> str:
    """The table field of a message from stage ``sender`` to ``receiver`` (``kind`` "F", a
    forward message, or "B", an input gradient): round the ring one way (to the stage after,
    or back to the one before) where it can, as a one-way schedule's, else the other."""
    step = (receiver - sender) % n_stages
    if kind == "F" and step == 1 % n_stages:
        return "recv_forward"
    if kind == "B" and step == (n_stages - 1) % n_stages:
        return "recv_backward"
    if step == 0:
        return "recv_forward_self" if kind == "F" else "recv_backward_self"
    return "recv_forward_after" if kind == "F" else "recv_backward_before"


def _numbered(name: str, rows: list, where: tuple[int, ...], n_local: int, n_micro: int) -> Table:
    """The table of ``rows``, each stage's buffers numbered: a slot is taken when its
    contents arrive (residuals at the F, the stash at the B) and free again at the tick
    after the pass that last reads it."""
    n_ticks, n_chunks, n_stages = len(rows), len(where), len(rows[0]) if rows else 0
    local = [where[:c].count(where[c]) for c in range(n_chunks)]
    arrivals = ("recv_forward", "recv_backward", "recv_loss", *RETURNING)
    fields = ("kind", "chunk", "micro", *BUFFERS, *arrivals)
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
        arriving = []  # what was sent at t-1 arrives at t: (stage, field, key)
        for sender, sent in enumerate(rows[t - 1] if t else []):
            if sent is None or sent[0] == "W" or (sent[0] == "B" and sent[1] == 0):
                continue
            kind, c, m = sent
            if kind == "F" and c == n_chunks - 1:  # the loss's gradient
                arriving.append((sender, "recv_loss", (c, m)))
                continue
            to = c + 1 if kind == "F" else c - 1
            arriving.append((where[to], _arrival(kind, sender, where[to], n_stages), (to, m)))
        for d, field, key in sorted(arriving, key=lambda a: (a[0], arrivals.index(a[1]))):
            arrays[field][t, d] = take("inbox" if "forward" in field else "grad", d, key)
        for d, action in enumerate(row):
            if action is None:
                continue
            kind, c, m = action
            arrays["kind"][t, d] = KINDS[kind]
            arrays["chunk"][t, d] = local[c]
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
    return Table(name, n_stages, n_local, n_micro, where, **arrays)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule by name: each stage's passes for S stages, M microbatches and V
    chunks per stage (``passes(S, M, V)``), whether a chunk's input gradient waits for its
    W (``fused``), the bubble its authors promise (``formula(S, M, V)``), where its chunks
    live (``placement``: :func:`looped` or :func:`v_shape`, or a function of its own), and
    the V it runs where it runs one alone (``repeats``: ZB-V's 2; pp then takes it).

    A plugin adds one by giving :class:`shardplug.strategies.pp.PipelineParallel` (``pp``) a
    ``Schedule`` as its ``schedule`` option, or by registering it under the entry-point
    group ``shardplug.schedules`` so ``-o pp.schedule=NAME`` finds it."""

    name: str
    passes: Callable[[int, int, int], Sequence[Sequence[Pass]]]
    formula: Callable[[int, int, int], float]
    fused: bool = False
    chunked: bool = False  # runs V > 1 chunks per stage (``repeats``)
    description: str = ""
    placement: Placement = looped
    repeats: int | None = None

    def table(self, stages: int, microbatches: int, chunks: int = 1) -> Table:
        """The schedule's :class:`Table`."""
        return tabulate(self.name, self.passes(stages, microbatches, chunks), chunks,
                        fused=self.fused, placement=self.placement)  # fmt: skip
