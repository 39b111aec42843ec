"""Reading a compiled step's HLO: which collectives it runs, how many, and how many bytes."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from shardplug.core.sharding import mesh_axes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")


_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in one dtype: how many ops, the bytes they produce, and the
    bytes each device sends for them with ring algorithms (``wire_bytes``)."""

    kind: str
    dtype: str
    count: int
    bytes: int
    wire_bytes: int = 0


def wire_bytes(kind: str, result_bytes: float, group: int) -> float:
    """Bytes one device sends for a collective over ``group`` devices, ring algorithms.

    An all-gather producing S bytes sends (g-1)/g S; a reduce-scatter producing S bytes (of
    g S in) sends (g-1) S; an all-reduce of S bytes is a reduce-scatter and an all-gather,
    2 (g-1)/g S; an all-to-all sends (g-1)/g S; a collective-permute sends S.
    """
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {
        "all-reduce": 2 * share * result_bytes,
        "all-gather": share * result_bytes,
        "reduce-scatter": (group - 1) * result_bytes,
        "all-to-all": share * result_bytes,
        "collective-permute": float(result_bytes),
    }[kind]


def _group_size(line: str, everyone: int) -> int:
    """The devices of one group of a collective's ``replica_groups``, in each form XLA
    prints: an iota (``[4,2]<=[8]``), a list (``{{0,1},{2,3}}``), every device (``{}``), or
    the mesh's axes (``mesh['data'=2,'context'=4] {'context'}``, XLA since JAX 0.11)."""
    named = _MESH_GROUPS.search(line)
    if named:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", named[1])}
        axes = re.findall(r"'([^']+)'", named[2])
        if all(name in sizes for name in axes):
            return math.prod(sizes[name] for name in axes)
    iota = _IOTA_GROUPS.search(line)
    if iota:
        return int(iota.group(2))
    listed = _LIST_GROUPS.search(line)
    if listed:
        return len([d for d in listed.group(1).strip("{}").split(",") if d])
    return everyone  # replica_groups={} : every device


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def _called(line: str) -> tuple[tuple[str, str], ...]:
    """The computations an instruction's line calls, each as ``(role, name)``: a loop's
    ``body`` and ``condition``, every branch of a conditional, a fusion's or call's."""
    return tuple((role, name.strip(" {}%")) for role, names in _CALLS.findall(line)
                 for name in names.split(",") if name.strip(" {}%"))  # fmt: skip


_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _runs(lines: list[str]) -> dict[int, int]:
    """For each line, how many times one step runs it: 1, times the known trip count of
    every while loop around it (a layer stack's scan, microbatches, a pipeline's ticks). A
    conditional's branch counts once: which iterations take it, the program does not say
    (pp's reports count a schedule's sending ticks from its table)."""
    owner, calls, entry, current = {}, collections.defaultdict(list), None, None
    for i, line in enumerate(lines):
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(1)
            entry = current if line.startswith("ENTRY") else entry
            continue
        owner[i] = current
        trips = _TRIPS.search(line)
        for role, name in _called(line):
            if role != "branch_computations":
                times = int(trips.group(1)) if role == "body" and trips else 1
                calls[name].append((current, times))
    memo: dict[str | None, int] = {entry: 1}

    def runs(name: str | None, depth: int = 0) -> int:
        if name not in memo:
            callers = calls.get(name, [])
            memo[name] = (
                sum(runs(c, depth + 1) * t for c, t in callers) if callers and depth < 64 else 1
            )
        return memo[name]

    return {i: runs(name) for i, name in owner.items()}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled program: its name, opcode (``all-gather``,
    ``conditional``, ``while``...), operands (names), line of HLO text, the computations it
    calls, each as ``(role, name)`` (``body``, ``condition``, ``branch_computations``,
    ``calls``, ``to_apply``), and whether it is its computation's root."""

    opcode: str
    text: str
    calls: tuple[tuple[str, str], ...]
    name: str = ""
    operands: tuple[str, ...] = ()
    root: bool = False


_OPCODE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """A compiled program's structure: each computation of its HLO text (by name) and its
    instructions, in order. What a program's metadata names (``op_name``) moves between JAX
    versions; which computation calls which does not."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = out.setdefault(head.group(1), [])
            continue
        op = _OPCODE.match(line) if current is not None else None
        if op is None:
            continue
        current.append(Instruction(op.group(3), line, _called(line), op.group(2),
                                   _operands(line, op.end()), bool(op.group(1))))  # fmt: skip
    return out


def _operands(line: str, start: int) -> tuple[str, ...]:
    """The operand names of an instruction whose operand list opens before ``start``."""
    depth, end = 1, start
    while end < len(line) and depth:
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return tuple(re.findall(r"%([\w.\-]+)", line[start:end]))


_INDEX = ("partition-id", "replica-id")  # a device's own index


class Varying:
    """Which values of a compiled program may differ between its devices: those computed
    from a device's own index (``partition-id``, ``replica-id``: ``lax.axis_index`` in a
    per-device program), followed through tuples, loops (a value carried round a loop from
    its start and its body) and conditionals. A conditional whose predicate varies runs
    another branch on some devices than on others: what pp's passes are, found by what they
    compute, not by the names the program's metadata gives them."""

    def __init__(self, program: dict[str, list[Instruction]]):
        self.program = program
        self.defs = {c: {i.name: i for i in ins} for c, ins in program.items()}
        self.roots = {c: next((i for i in ins if i.root), None) for c, ins in program.items()}
        self.callers: dict[str, list[tuple[str, Instruction]]] = collections.defaultdict(list)
        for c, ins in program.items():
            for i in ins:
                for _, callee in i.calls:
                    self.callers[callee].append((c, i))
        self.memo: dict[tuple[str, str, int | None], bool] = {}
        self.known: set[tuple[str, str, int | None]] = set()  # found to vary
        self.indexed: dict[str, bool] = {}

    def _indexed(self, computation: str) -> bool:
        """Whether ``computation`` or one it calls reads the device's index."""
        if computation not in self.indexed:
            found = reached(self.program, computation)
            self.indexed[computation] = any(i.opcode in _INDEX for i in found)
        return self.indexed[computation]

    def __call__(self, computation: str, name: str, index: int | None = None) -> bool:
        """Whether value ``name`` of ``computation`` (its element ``index``, of a tuple) may
        differ between devices. A value carried round a loop is first taken not to, then
        asked again with what was found to vary, until nothing more is."""
        while True:
            self.memo = dict.fromkeys(self.known, True)
            found = self._value(computation, name, index)
            more = {k for k, v in self.memo.items() if v} - self.known
            if not more:
                return found
            self.known |= more

    def _value(self, computation: str, name: str, index: int | None = None) -> bool:
        key = (computation, name, index)
        if key not in self.memo:
            self.memo[key] = False  # round a loop: until asked again
            self.memo[key] = self._varies(computation, self.defs[computation].get(name), index)
        return self.memo[key]

    def _varies(self, c: str, i: Instruction | None, index: int | None) -> bool:
        if i is None:
            return True  # not found: assume the worst
        op, args = i.opcode, i.operands
        if op in _INDEX:
            return True
        if op == "parameter":
            return self._parameter(c, index)
        if op == "get-tuple-element":
            return self._value(c, args[0], int(re.search(r"index=(\d+)", i.text)[1]))
        if op == "tuple" and index is not None:
            return index < len(args) and self._value(c, args[index])
        if op == "while":
            return self._value(c, args[0], index) or self._root(dict(i.calls)["body"], index)
        if op == "conditional":
            return self._value(c, args[0]) or any(self._root(b, index) for _, b in i.calls)
        return any(self._value(c, a) for a in args) or any(self._indexed(n) for _, n in i.calls)

    def _root(self, computation: str, index: int | None) -> bool:
        root = self.roots.get(computation)
        return root is None or self._value(computation, root.name, index)

    def _parameter(self, c: str, index: int | None) -> bool:
        """A loop's or a branch's one parameter: what each caller passes it (a loop also
        what its body carries round)."""
        callers = self.callers.get(c, [])
        if not callers:
            return False  # the program's own arguments: every device's share of the same
        for caller, i in callers:
            role = next(r for r, n in i.calls if n == c)
            if role in ("body", "condition") and self._value(caller, i.operands[0], index):
                return True
            if role in ("body", "condition") and self._root(dict(i.calls)["body"], index):
                return True
            if role == "branch_computations":
                k = [n for _, n in i.calls].index(c)
                if self._value(caller, i.operands[k + 1], index):
                    return True
            if role not in ("body", "condition", "branch_computations"):
                return True  # a fusion or call's parameters: not followed
        return False

    def divergent(self) -> list[tuple[str, Instruction]]:
        """Every conditional whose predicate may differ between devices, with its
        computation."""
        return [(c, i) for c, ins in self.program.items() for i in ins
                if i.opcode == "conditional" and self(c, i.operands[0])]  # fmt: skip


def source_of(hlo_text: str, instruction: Instruction) -> str | None:
    """Where the code that made ``instruction`` is (``file:line``, the path relative to the
    working folder): the innermost frame of its ``stack_frame_id`` in the program's
    ``StackFrames`` table (JAX leaves its own frames out); None where the program says none."""
    frame = re.search(r"stack_frame_id=(\d+)", instruction.text)
    tables = {title: dict(re.findall(r"^(\d+) (.*)$", body, re.M)) for title, body in
              re.findall(r"^(FileNames|FileLocations|StackFrames)\n((?:\d+ .*\n?)*)",
                         hlo_text, re.M)}  # fmt: skip
    entry = tables.get("StackFrames", {}).get(frame[1]) if frame else None
    at = re.search(r"file_location_id=(\d+)", entry or "")
    location = tables.get("FileLocations", {}).get(at[1], "") if at else ""
    found = re.search(r"file_name_id=(\d+).*?\bline=(\d+)", location)
    path = tables.get("FileNames", {}).get(found[1], "").strip('"') if found else ""
    return f"{os.path.relpath(path)}:{found[2]}" if path else None


def reached(
    program: dict[str, list[Instruction]],
    name: str,
    through: Callable[[Instruction], bool] = lambda _: True,
) -> list[Instruction]:
    """The instructions of computation ``name`` of ``program`` (:func:`computations`) and of
    every computation its instructions call, where ``through(instruction)`` allows (all by
    default), each once."""
    seen, todo, out = {name}, [name], []
    while todo:
        for instruction in program.get(todo.pop(), []):
            out.append(instruction)
            if through(instruction):
                fresh = [c for _, c in instruction.calls if c not in seen]
                seen.update(fresh)
                todo += fresh
    return out


@dataclasses.dataclass(frozen=True)
class CollectiveArray:
    """One array a collective of the step produces: the op's kind (``op``: its line in the
    module, shared by the arrays of one op over a tuple), the array's dtype, dimensions and
    bytes, the devices of its group, and how many times one step runs it (``times``: the
    known trip counts of the loops around it)."""

    op: int
    kind: str
    dtype: str
    dims: tuple[int, ...]
    bytes: int
    group: int
    times: int


def collective_arrays(hlo_text: str) -> list[CollectiveArray]:
    """Every array of every collective in an HLO module's text (an op over a tuple, as XLA
    combines small all-reduces, gives one per member), results only."""
    partitions = _PARTITIONS.search(hlo_text)
    everyone = int(partitions.group(1)) if partitions else 1
    lines = hlo_text.splitlines()
    runs = _runs(lines)
    out = []
    for i, line in enumerate(lines):
        match = _OP.match(line)
        if match is None:
            continue
        shape, kind, started = match.groups()
        found = _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape))
        if started and kind != "all-reduce" and len(found) % 2 == 0:
            found = found[len(found) // 2 :]  # async (operands, results): the results
        group = _group_size(line, everyone)
        for dtype, text in found:
            dims = tuple(int(d) for d in text.split(",") if d)
            nbytes = _BYTES[dtype] * math.prod(dims)
            out.append(CollectiveArray(i, kind, dtype, dims, nbytes, group, runs.get(i, 1)))
    return out


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, grouped by kind and dtype, as one step
    runs them: an op inside a while loop of known trip count counts once per iteration.

    ``bytes`` is the size of each op's result summed over the ops (for an all-reduce the
    reduced buffer, for an all-gather the gathered one), per device. An op over a tuple
    (XLA combines small all-reduces) counts once, with all its arrays.
    """
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    size: collections.Counter[tuple[str, str]] = collections.Counter()
    wire: collections.Counter[tuple[str, str]] = collections.Counter()
    seen: set[tuple[int, str]] = set()
    for a in collective_arrays(hlo_text):
        size[a.kind, a.dtype] += a.bytes * a.times
        wire[a.kind, a.dtype] += wire_bytes(a.kind, a.bytes, a.group) * a.times
        if (a.op, a.dtype) not in seen:
            count[a.kind, a.dtype] += a.times
            seen.add((a.op, a.dtype))
    return [Collective(k, d, count[k, d], size[k, d], round(wire[k, d])) for k, d in sorted(size)]


def partitioned_hlo(lowered: Any) -> str:
    """The step's HLO right after SPMD partitioning: the collectives the program asks for,
    before the backend rewrites them (XLA's CPU backend, for one, runs bfloat16 all-reduces
    in float32, since its collectives do not implement bfloat16 reductions). Compiled afresh,
    outside JAX's persistent compilation cache: a program from it runs no pass, so dumps none."""
    from shardplug.core.cache import uncached

    with tempfile.TemporaryDirectory() as folder:
        with uncached():
            dump = {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"}
            lowered.compile(compiler_options=dump)
        found = sorted(f for f in os.listdir(folder) if "after_spmd-partitioning" in f)
        if not found:
            raise RuntimeError("XLA wrote no HLO after SPMD partitioning")
        with open(os.path.join(folder, found[-1])) as file:
            return file.read()


def textbook_collectives(
    shard_bytes: list[int],
    stored: list[Any],
    used: list[Any],
    mesh: Any,
    batch_axes: Any,
    parts: list[int] | None = None,
) -> list[dict[str, Any]]:
    """A strategy's collectives as the literature states them, parameter by parameter, from
    each parameter's bytes per device and its ``stored`` and ``used`` PartitionSpecs.

    A parameter replicated over batch axes has its gradient all-reduced over them (data
    parallel). One stored split over batch axes but whole there where the step uses it is
    all-gathered in the forward and again in the backward pass and its gradient
    reduce-scattered (ZeRO-3); one still split where it is used (experts placed by device) is
    neither gathered nor reduced over those axes. Bytes are result bytes per device, as
    :func:`collectives` counts them. Parameters split over axes the batch is not split on
    (tensor parallelism) add activation collectives that depend on the model's code, and
    experts add their tokens' all-to-alls: those are not modelled.

    :param parts: how many parts each parameter's gradient is reduced in (default 1): a
        parameter the step uses twice (a tied embedding) has a gradient of two parts, which
        a compiled program may reduce one by one (:func:`gradient_parts`); each counts.
    """
    if math.prod(mesh.shape[a] for a in batch_axes) == 1:
        return []
    totals = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    wire = dict.fromkeys(totals, 0.0)
    parts = parts or [1] * len(shard_bytes)
    for shard, spec, at_use, n in zip(shard_bytes, stored, used, parts, strict=True):
        split = [a for a in mesh_axes(spec) if a in batch_axes]
        local = {a for a in mesh_axes(at_use) if a in batch_axes}
        gathered = [a for a in split if a not in local]
        rest = [a for a in batch_axes if a not in split and mesh.shape[a] > 1]
        if gathered:
            group = math.prod(mesh.shape[a] for a in gathered)
            totals["all-gather"] += 2 * shard * group
            wire["all-gather"] += 2 * wire_bytes("all-gather", shard * group, group)
            totals["reduce-scatter"] += n * shard
            wire["reduce-scatter"] += n * wire_bytes("reduce-scatter", shard, group)
        if rest:
            totals["all-reduce"] += n * shard
            wire["all-reduce"] += n * wire_bytes(
                "all-reduce", shard, math.prod(mesh.shape[a] for a in rest)
            )
    what = {
        "all-reduce": "the gradients of parameters replicated over the batch axes",
        "all-gather": "parameters split over the batch axes, gathered forward and backward",
        "reduce-scatter": "the gradients of those parameters, onto each device's shard",
    }
    return [
        {"kind": k, "bytes": b, "wire_bytes": round(wire[k]), "what": what[k]}
        for k, b in totals.items()
        if b
    ]


def gradient_parts(
    hlo_text: str, dims: list[tuple[int, ...]], groups: list[int]
) -> list[dict[str, Any]]:
    """Gradients a compiled step all-reduces in parts: where a parameter is used more than
    once (an embedding tied to the output: the lookup and the logits' product), its gradient
    is the sum of one part per use, and XLA's CPU compiler reduces each part where it is made
    and adds them after (its GPU compiler adds them first and reduces once:
    ``AllReduceReassociate``). Found as more all-reduced arrays, outside loops, of a
    parameter's dimensions where it is used (``dims``) over the devices its gradient is
    reduced over (``groups``) than there are such parameters. Matrices and larger only: a
    vector's dimensions are also those of batch statistics (BatchNorm's means, all-reduced
    over the batch), which are activations' traffic.

    :return: per dimensions and group with parts over: ``{"params": [indices], "dims",
        "parts": arrays found, "extra_bytes", "extra_wire_bytes"}``, the extra arrays' bytes
        per device and the bytes each device sends for them (ring).
    """
    wanted: dict[tuple, list[int]] = collections.defaultdict(list)
    surplus: collections.Counter[int] = collections.Counter()  # elements, by group
    for i, (shape, group) in enumerate(zip(dims, groups, strict=True)):
        surplus[group] -= math.prod(shape)
        if group > 1 and len(shape) > 1:
            wanted[tuple(shape), group].append(i)
    found: dict[tuple, list[CollectiveArray]] = collections.defaultdict(list)
    for a in collective_arrays(hlo_text):
        if a.kind == "all-reduce" and a.times == 1:
            surplus[a.group] += math.prod(a.dims)
            if (a.dims, a.group) in wanted:
                found[a.dims, a.group].append(a)
    out = []
    for key, params in wanted.items():
        # no more than the group's all-reduces hold beyond its gradients: a gradient that
        # XLA reshaped to another parameter's dimensions is no part
        extra = []
        for a in found[key][len(params) :]:
            if math.prod(a.dims) <= surplus[key[1]]:
                surplus[key[1]] -= math.prod(a.dims)
                extra.append(a)
        if extra:
            out.append({
                "params": params, "dims": list(key[0]), "parts": len(params) + len(extra),
                "extra_bytes": sum(a.bytes for a in extra),
                "extra_wire_bytes": round(sum(wire_bytes(a.kind, a.bytes, a.group)
                                              for a in extra)),
            })  # fmt: skip
    return out
