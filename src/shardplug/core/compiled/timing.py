"""A step's time, predicted from the program the device would run.

The compiled program is a schedule of kernels: matrix products, fused attention, fusions of
element-wise work and reductions, collectives over links, copies between host and device,
and loops around them. :func:`predict_step` walks that schedule once and gives each kernel
a time from its own FLOPs and bytes against a :class:`~shardplug.core.compiled.chips.Chip`'s figures
(:mod:`shardplug.core.compiled.kernel_time`), each collective the
time its bytes take over its link, and each copy its bytes over PCIe. What runs
asynchronously (every ``*-start``/``*-done`` pair the scheduler placed) runs on its own
stream: the step waits for it only where its ``-done`` comes before it has finished, which
is the communication the schedule leaves exposed.

How each kernel is timed (GPUs compile untuned here, so the model is of the tuned kernel a
GPU would pick, not of the tile the program names):

- a **matrix product** (a GEMM fusion, a cuBLAS call, a convolution) runs at the chip's peak
  for its operands' dtype times one efficiency a large tuned GEMM reaches
  (``gemm_efficiency``), less what its shape loses to tiles and waves: the output is cut
  into tiles, and the tiles run in waves over the chip's cores; the autotuner's choice is
  the tile (of those a tuned library offers) that finishes first. Bounded below by its
  bytes over memory (small or thin products are memory-bound);
- **fused attention** (cuDNN's, or a Triton flash kernel) runs its 2 products forward and 5
  backward (halved when causal) at the efficiency published for flash attention at its head
  dimension (``attention_efficiency``);
- **every other kernel** moves the bytes it reads and writes (a slice reads its slice; an
  in-place update writes its update) at ``memory_efficiency`` of the memory's bandwidth, or
  computes its element-wise arithmetic, whichever is longer;
- each kernel costs ``launch_seconds`` on top;
- a **collective** moves the bytes a ring sends (:func:`shardplug.core.compiled.hlo.wire_bytes`)
over
  its link (NVLink inside a host, the network between hosts) plus the link's latency;
- a **copy** between host and device moves its bytes over PCIe, one stream each way.

Loops run their body their known trip count times, each iteration walked where a
conditional in the body picks its branch by the iteration (a pipeline's ticks): which branch
each device takes is computed from the program's own tables
(:mod:`shardplug.core.compiled.branches`),
each device walks its own branches through an iteration, and the iteration lasts as long as
the slowest device's walk; where a branch cannot be told, the longest.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from shardplug.core.compiled.branches import Evaluator, Loop
from shardplug.core.compiled.chips import Chip, calibrated, chip_of
from shardplug.core.compiled.hlo import Instruction, wire_bytes
from shardplug.core.compiled.kernel_time import FREE, Kernels
from shardplug.core.compiled.program import (
    Program,
    first_group,
    in_host_memory,
    program_text,
    result,
)
from shardplug.core.compiled.program import nbytes as size_of


@dataclasses.dataclass
class Part:
    """One kind of work of a step: how many kernels (or ops), their FLOPs and bytes, and the
    seconds they take (``exposed``: of an asynchronous kind, the seconds the step waited)."""

    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    exposed: float = 0.0

    def add(self, times: float, flops: float, nbytes: float, seconds: float) -> None:
        self.count += round(times)
        self.flops += times * flops
        self.bytes += times * nbytes
        self.seconds += times * seconds


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A predicted step: its seconds, and each part's (``parts``: ``matmul bf16``,
    ``attention``, ``memory-bound``, ``all-gather (local)``, ``host copies (to device)``...,
    each with its kernels, FLOPs, bytes, seconds and, for what runs asynchronously, the
    seconds the step waited for it: ``exposed``)."""

    seconds: float
    chip: str
    parts: dict[str, dict[str, float]]
    #: conditionals whose branch the program's arithmetic did not tell (the longest taken)
    unresolved: int = 0
    #: the kernels that take the most of the step, largest first: ``{"kernel", "part",
    #: "seconds", "runs", "op"}`` (``op``: the JAX operation that made it, as the program's
    #: metadata names it)
    largest: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def compute_seconds(self) -> float:
        """The kernels' own time, communication and copies aside."""
        return sum(p["seconds"] for k, p in self.parts.items() if not _asynchronous(k))

    @property
    def exposed_seconds(self) -> float:
        """The seconds communication and copies add to the step: what the schedule did not
        hide behind kernels."""
        return sum(p["exposed"] for k, p in self.parts.items() if _asynchronous(k))

    def share(self, part: str) -> float:
        found = self.parts.get(part)
        return found["seconds"] / self.seconds if found and self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "chip": self.chip,
            "compute_seconds": self.compute_seconds,
            "exposed_seconds": self.exposed_seconds,
            "parts": self.parts,
            "unresolved": self.unresolved,
            "largest": self.largest,
        }

    def lines(self) -> list[str]:
        """The parts, largest first, one line each."""
        out = []
        for name, p in sorted(self.parts.items(), key=lambda kv: -kv[1]["seconds"]):
            if _asynchronous(name):
                hidden = p["seconds"] - p["exposed"]
                out.append(
                    f"{name}: {_ms(p['seconds'])} for {_gb(p['bytes'])}, "
                    f"{_ms(p['exposed'])} exposed ({_ms(hidden)} hidden behind kernels)"
                )
            elif p["flops"] and name != "memory-bound":
                rate = p["flops"] / p["seconds"] / 1e12 if p["seconds"] else 0.0
                out.append(
                    f"{name}: {_ms(p['seconds'])} in {p['count']:,} kernels, "
                    f"{p['flops'] / 1e12:,.2f} TFLOP at {rate:,.0f} TFLOP/s"
                )
            elif name == _ITERATIONS:
                out.append(f"{name}: {_ms(p['seconds'])} over {p['count']:,}")
            else:
                out.append(f"{name}: {_ms(p['seconds'])} in {p['count']:,} kernels, "
                           f"{_gb(p['bytes'])} moved")  # fmt: skip
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f} GB"


def _asynchronous(part: str) -> bool:
    return part.startswith(("host copies", *_COLLECTIVES))


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "ragged-all-to-all", "collective-broadcast")  # fmt: skip


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


#: the part of a step that is its loops' iterations and conditionals, beyond their kernels
_ITERATIONS = "loop iterations and branches"
#: how many of the largest kernels a prediction lists
_LARGEST = 10
#: loops whose body branches are walked iteration by iteration up to this many iterations
_WALKED = 4096


@dataclasses.dataclass
class _Clock:
    """Where a simulated schedule stands: the compute stream's time, each asynchronous
    stream's free time, and each started op's finish."""

    now: float = 0.0
    free: dict[str, float] = dataclasses.field(default_factory=dict)
    pending: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)


class _Predictor:
    def __init__(self, program: Program, chip: Chip):
        self.program, self.chip = program, chip
        self.parts: dict[str, Part] = collections.defaultdict(Part)
        self.branch_memo: dict[tuple[str, float], tuple[float, dict[str, Part], Any]] = {}
        self.kernels = Kernels(program, chip)
        self.unresolved = 0  # conditionals whose branch could not be told
        #: each kernel's seconds in the step, by (computation, name)
        self.spent: collections.Counter[tuple[str, str]] = collections.Counter()

    def largest(self, count: int) -> list[dict[str, Any]]:
        """The ``count`` kernels that take the most of the step."""
        out = []
        for (computation, name), seconds in self.spent.most_common(count):
            i = self.program.defs[computation][name]
            part, _, _, each = self.kernels.kernel(computation, i)
            op = re.search(r'op_name="([^"]*)"', i.text)
            out.append({"kernel": name, "part": part, "seconds": seconds,
                        "runs": round(seconds / each) if each else 0,
                        "op": op.group(1) if op else ""})  # fmt: skip
        return out

    # the schedule ------------------------------------------------------------------

    def run(self, computation: str, times: float, clock: _Clock,
            loop: Loop | None = None, device: int | None = None) -> None:  # fmt: skip
        """Advance ``clock`` through ``computation``'s schedule; every kernel's work counts
        ``times`` times in the parts (the loops around it). ``loop``: the iteration of the
        loop whose body this is, which the branches a conditional takes may depend on;
        ``device``: the one device whose branches are taken (None: the slowest's)."""
        for i in self.program.computations.get(computation, []):
            op = i.opcode
            if op in FREE:
                continue
            if op == "while":
                self._loop(computation, i, times, clock)
            elif op == "conditional":
                self._branches(computation, i, times, clock, loop, device)
            elif op == "call":
                for _, callee in i.calls:
                    self.run(callee, times, clock)
            elif op == "fusion-start" and "S(5)" in i.text:  # a slice to or from the host
                self._start(computation, i, times, clock)
            elif op == "fusion-done" and i.operands and i.operands[0] in clock.pending:
                self._done(i, times, clock)
            elif op in ("fusion-start", "fusion-done"):  # a kernel started asynchronously
                if op == "fusion-start":
                    part, flops, nbytes, seconds = self.kernels.kernel(computation, i)
                    self.parts[part].add(times, flops, nbytes, seconds)
                    self.spent[computation, i.name] += times * seconds
                    clock.now += seconds
            elif op.endswith("-start") or op == "async-start":
                self._start(computation, i, times, clock)
            elif op.endswith("-done") or op == "async-done":
                self._done(i, times, clock)
            elif op.endswith("-update") or op == "async-update":
                continue
            elif op in _COLLECTIVES:
                seconds = self._collective(computation, i, op, times)
                clock.now += seconds
                self.parts[self._link_part(op, computation, i)].exposed += times * seconds
            elif op in ("send", "recv", "send-done", "recv-done"):
                continue
            else:
                part, flops, nbytes, seconds = self.kernels.kernel(computation, i)
                self.parts[part].add(times, flops, nbytes, seconds)
                self.spent[computation, i.name] += times * seconds
                clock.now += seconds

    def _loop(self, computation: str, i: Instruction, times: float, clock: _Clock) -> None:
        """A while loop: its body as many times as its known trip count says, each iteration
        walked where a conditional in the body may take another branch on another one."""
        calls = dict(i.calls)
        body, condition = calls.get("body", ""), calls.get("condition", "")
        found = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i.text)
        trips = int(found.group(1)) if found else 1
        index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}', i.text)
        steps = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}', i.text)
        start = clock.now
        cond = _Clock()
        self.run(condition, times * (trips + 1), cond)
        per_iteration = self.chip.loop_seconds * self.chip.shared_by + cond.now
        branching = any(x.opcode == "conditional" for x in self.program.computations.get(body, []))
        if branching and index and steps and trips <= _WALKED:
            init, step = int(steps.group(1)), int(steps.group(2))
            for k in range(trips):
                loop = Loop(body, int(index.group(1)), init + k * step)
                clock.now += self._iteration(body, times, clock, loop) + per_iteration
        else:
            inner = _Clock(free=dict.fromkeys(clock.free, 0.0))
            self.run(body, times * trips, inner)
            clock.now = start + trips * (inner.now + per_iteration)
        clock.now += cond.now
        self.parts[_ITERATIONS].add(times * trips, 0.0, 0.0,
                                    self.chip.loop_seconds * self.chip.shared_by)  # fmt: skip

    def _iteration(self, body: str, times: float, clock: _Clock, loop: Loop) -> float:
        """One iteration of a loop whose branches differ by device (a pipeline's tick): each
        device walks its own branches, and the iteration lasts as long as the slowest
        device's walk (the devices meet at the end of the iteration, where the tick's sends
        are); its parts are the slowest device's."""
        slowest: tuple[float, dict[str, Part], Any] | None = None
        for device in range(max(self.program.devices, 1)):
            saved, self.parts = self.parts, collections.defaultdict(Part)
            spent, self.spent = self.spent, collections.Counter()
            inner = _Clock(free=dict.fromkeys(clock.free, 0.0))
            self.run(body, times, inner, loop, device)
            walked = (inner.now, self.parts, self.spent)
            self.parts, self.spent = saved, spent
            if slowest is None or walked[0] > slowest[0]:
                slowest = walked
        self._merge(slowest[1], slowest[2])
        return slowest[0]

    def _merge(self, parts: dict[str, Part], spent: Any) -> None:
        self.spent.update(spent)
        for name, p in parts.items():
            mine = self.parts[name]
            mine.count += p.count
            mine.flops += p.flops
            mine.bytes += p.bytes
            mine.seconds += p.seconds
            mine.exposed += p.exposed

    def _branches(self, computation: str, i: Instruction, times: float, clock: _Clock,
                  loop: Loop | None, device: int | None = None) -> None:  # fmt: skip
        """The branch a device takes, where the program says (its index computed from the
        loop's iteration, the device's own index and constants): ``device``'s, or where it
        is None the slowest device's (the step waits for it). Where it cannot be told, the
        longest branch."""
        branches = [c for r, c in i.calls if r in _BRANCHES]
        taken = set()
        devices = range(max(self.program.devices, 1)) if device is None else (device,)
        for one in devices:
            chosen = Evaluator(self.program, loop, one).branch(computation, i)
            if chosen is None:
                taken = set(range(len(branches)))
                self.unresolved += 1
                break
            taken.add(min(chosen, len(branches) - 1))
        best: tuple[float, dict[str, Part], Any] | None = None
        for k in sorted(taken):
            found = self._branch(branches[k], times)
            if best is None or found[0] > best[0]:
                best = found
        if best is not None:
            self._merge(best[1], best[2])
            clock.now += best[0] + self.chip.loop_seconds
            self.parts[_ITERATIONS].add(times, 0.0, 0.0, self.chip.loop_seconds)

    def _branch(self, branch: str, times: float) -> tuple[float, dict[str, Part], Any]:
        """One branch simulated alone: its seconds, its parts and its kernels' seconds
        (counted ``times``)."""
        key = (branch, times)
        if key not in self.branch_memo:
            saved, self.parts = self.parts, collections.defaultdict(Part)
            spent, self.spent = self.spent, collections.Counter()
            inner = _Clock()
            self.run(branch, times, inner)
            self.branch_memo[key] = (inner.now, self.parts, self.spent)
            self.parts, self.spent = saved, spent
        return self.branch_memo[key]

    def _start(self, computation: str, i: Instruction, times: float, clock: _Clock) -> None:
        kind, stream, seconds, nbytes = self._asynchronous(computation, i, times)
        if kind is None:  # an asynchronous computation: a kernel on another stream
            return
        begin = max(clock.now, clock.free.get(stream, 0.0))
        clock.free[stream] = begin + seconds
        clock.pending[i.name] = (begin + seconds, kind)
        part = self.parts[kind]
        part.count += round(times)
        part.bytes += times * nbytes
        part.seconds += times * seconds

    def _done(self, i: Instruction, times: float, clock: _Clock) -> None:
        started = clock.pending.pop(i.operands[0], None) if i.operands else None
        if started is None:
            return
        end, kind = started
        if end > clock.now:
            self.parts[kind].exposed += times * (end - clock.now)
            clock.now = end

    def _asynchronous(
        self, computation: str, i: Instruction, times: float
    ) -> tuple[str | None, str, float, float]:
        """What an asynchronous start begins: its part, its stream, its seconds and bytes."""
        op = i.opcode
        if op == "fusion-start":  # a slice written into, or read out of, host memory
            to_device = not in_host_memory(i)
            moved = self.kernels.host_slice_bytes(computation, i, to_device)
            kind = "host copies (to device)" if to_device else "host copies (to host)"
            return kind, kind, moved / self.chip.pcie + self.chip.launch_seconds, moved
        if op == "copy-start":
            to_device = not in_host_memory(i)
            arrays = result(i)
            nbytes = size_of(arrays[:1])
            kind = "host copies (to device)" if to_device else "host copies (to host)"
            return kind, kind, nbytes / self.chip.pcie + self.chip.launch_seconds, nbytes
        if op == "async-start":
            callee = next((c for r, c in i.calls if r == "calls"), None)
            inner = self.program.computations.get(callee or "", [])
            wrapped = next((w for w in inner if w.opcode in _COLLECTIVES), None)
            if wrapped is None:  # a computation run on another stream
                self.run(callee or "", times, _Clock())
                return None, "", 0.0, 0.0
            seconds = self._collective(callee, wrapped, wrapped.opcode, 1)
            part = self._link_part(wrapped.opcode, callee, wrapped)
            return part, "collectives", seconds, self._wire(callee, wrapped, wrapped.opcode)
        kind = op.removesuffix("-start")
        if kind in _COLLECTIVES:
            seconds = self._collective(computation, i, kind, 1)
            part = self._link_part(kind, computation, i)
            return part, "collectives", seconds, self._wire(computation, i, kind)
        return None, "", 0.0, 0.0

    # collectives -------------------------------------------------------------------

    def _group(self, i: Instruction) -> list[int]:
        """One group of a collective's devices (the first), by partition index."""
        return first_group(i.text, self.program.devices)

    def _crosses_hosts(self, i: Instruction, kind: str) -> bool:
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", i.text)
            found = re.findall(r"\{(\d+),(\d+)\}", (pairs.group(1) + "}") if pairs else "")
            per = self.chip.per_host
            return any(int(a) // per != int(b) // per for a, b in found)
        group = self._group(i)
        return len({d // self.chip.per_host for d in group}) > 1

    def _link_part(self, kind: str, computation: str, i: Instruction) -> str:
        link = "network" if self._crosses_hosts(i, kind) else "local"
        return f"{kind} ({link})"

    def _wire(self, computation: str, i: Instruction, kind: str) -> float:
        arrays = result(i)
        if i.opcode.endswith("-start") and kind != "all-reduce" and len(arrays) % 2 == 0:
            arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
        group = len(self._group(i)) if kind != "collective-permute" else 2
        if kind == "collective-permute":
            return float(size_of(arrays[:1]) if i.opcode.endswith("-start") else size_of(arrays))
        return wire_bytes(kind, size_of(arrays), group)

    def _collective(self, computation: str, i: Instruction, kind: str, times: float) -> float:
        """Seconds one collective takes over its link: the bytes a ring sends, and the link's
        latency."""
        nbytes = self._wire(computation, i, kind)
        link = "network" if self._crosses_hosts(i, kind) else "local"
        group = len(self._group(i)) if kind != "collective-permute" else 2
        if nbytes == 0 and group <= 1:
            return 0.0
        seconds = nbytes / self.chip.links[link] + self.chip.latency[link]
        if kind in _COLLECTIVES and not i.opcode.endswith("-start") and i.opcode == kind:
            self.parts[f"{kind} ({link})"].add(times, 0.0, nbytes, seconds)
        return seconds


def predict_step(program: Any, chip: Chip | str | None = None) -> StepTime:
    """The time of one step of a compiled program on ``chip``.

    :param program: a ``jax.stages.Compiled`` (shardplug's step, ``trainer.compiled``, or
        any hand-written ``jax.jit(...).lower(...).compile()`` for the same devices), or its
        HLO text (:func:`program_text`).
    :param chip: a :class:`~shardplug.core.compiled.chips.Chip`, or a GPU's name (``h100``,
        ``h200``, ``a100``); default: the GPU the program was compiled for.
    :raises ConfigError: no chip given for a program of another device, or an unknown name.
    """
    from shardplug.core.compiled.chips import CHIPS
    from shardplug.errors import ConfigError

    if not isinstance(program, str) and not hasattr(program, "runtime_executable"):
        what = type(program).__name__
        raise ConfigError(
            f"predict_step: give a compiled program (jax.jit(f).lower(...).compile(), or "
            f"trainer.compiled) or its HLO text, not a {what}"
            + (": compile it first" if hasattr(program, "compile") else "")
        )
    if chip is not None and not isinstance(chip, str | Chip):
        raise ConfigError(f"predict_step: chip is a GPU's name ('h100') or a Chip, not "
                          f"{chip!r}")  # fmt: skip
    text = program if isinstance(program, str) else program_text(program)
    if "ENTRY" not in text or "HloModule" not in text:
        raise ConfigError("predict_step: the text is no compiled program's HLO (it has no "
                          "HloModule and ENTRY computation)")  # fmt: skip
    if chip is None and not isinstance(program, str):
        chip = _chip_of_compiled(program)
    if isinstance(chip, str):
        if chip.lower() not in CHIPS:
            raise ConfigError(f"predict_step: no chip {chip!r}; choose one of {', '.join(CHIPS)}")
        chip = calibrated(chip.lower())
    if chip is None:
        raise ConfigError(
            "predict_step: the program is not compiled for a GPU shardplug knows; say which chip "
            "it runs on (chip='h100', or a Chip of measured figures)"
        )
    predictor = _Predictor(Program(text), chip)
    clock = _Clock()
    predictor.run(predictor.program.entry, 1.0, clock)
    parts = {k: dataclasses.asdict(v) for k, v in predictor.parts.items() if v.count or v.seconds}
    return StepTime(clock.now, chip.name, parts, predictor.unresolved,
                    predictor.largest(_LARGEST))  # fmt: skip


def _chip_of_compiled(compiled: Any) -> Chip | None:
    """The GPU a compiled program is for, where shardplug knows it."""
    try:
        devices = compiled.input_shardings[0]
        import jax

        device = next(iter(jax.tree.leaves(devices)[0].device_set))
    except Exception:  # no shardings to read: the caller says the chip
        return None
    return chip_of(device)
