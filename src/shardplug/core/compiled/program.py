"""A compiled program's values by name, with their shapes and bytes: what a prediction of
the step's time reads of each instruction (:mod:`shardplug.core.compiled.timing`)."""

from __future__ import annotations

import math
import re
from typing import Any

from shardplug.core.compiled.hlo import _ARRAY, _BYTES, Instruction, _group_size, computations

#: an instruction's result shape: the text between ``=`` and its opcode
_RESULT = re.compile(r"=\s*(.*?)\s+[a-z][\w\-]*\(")

Arrays = list[tuple[str, tuple[int, ...]]]


def arrays(shape_text: str) -> Arrays:
    """The arrays of a shape's text, each as ``(dtype, dimensions)``."""
    clean = re.sub(r"/\*.*?\*/", "", shape_text)
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(clean)]


def nbytes(found: Arrays) -> int:
    """The bytes of ``found`` arrays."""
    return sum(_BYTES[d] * math.prod(s) for d, s in found)


def result(i: Instruction) -> Arrays:
    """What an instruction makes (an asynchronous fusion's start: the fusion's result)."""
    found = _RESULT.search(i.text)
    if not found:
        return []
    if i.opcode == "fusion-start":  # ((operands), result, context): the result
        parts = elements(found.group(1))
        return arrays(parts[1]) if len(parts) == 3 else []
    return arrays(found.group(1))


def elements(shape_text: str) -> list[str]:
    """A tuple shape's elements, as text (a plain shape: itself)."""
    text = re.sub(r"/\*.*?\*/", "", shape_text).strip()
    if not text.startswith("("):
        return [text]
    out, depth, current = [], 0, ""
    for ch in text[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    return [*out, current.strip()] if current.strip() else out


def in_host_memory(i: Instruction) -> bool:
    """Whether an instruction's result lives in host memory (memory space ``S(5)``; of an
    asynchronous fusion's start, the fusion's result; of a copy's start, its destination)."""
    found = _RESULT.search(i.text)
    if not found:
        return False
    if i.opcode in ("fusion-start", "copy-start"):  # (operands, result, context) and
        parts = elements(found.group(1))  # (destination, source, context)
        return len(parts) == 3 and "S(5)" in parts[i.opcode == "fusion-start"]
    return "S(5)" in found.group(1)


class Program:
    """A compiled program's computations, with each value's shape by name."""

    def __init__(self, hlo_text: str):
        self.text = hlo_text
        self.computations = computations(hlo_text)
        self.defs = {c: {i.name: i for i in ins} for c, ins in self.computations.items()}
        entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.MULTILINE)
        self.entry = entry.group(1) if entry else next(iter(self.computations), "")
        partitions = re.search(r"num_partitions=(\d+)", hlo_text)
        self.devices = int(partitions.group(1)) if partitions else 1

    def shape(self, computation: str, name: str) -> Arrays:
        """The shape of value ``name`` of ``computation`` (none where it is not found)."""
        found = self.defs.get(computation, {}).get(name)
        return result(found) if found is not None else []

    def operand_bytes(self, computation: str, i: Instruction) -> int:
        """The bytes of everything ``i`` reads, whole."""
        return sum(nbytes(self.shape(computation, o)) for o in i.operands)


def first_group(line: str, everyone: int) -> list[int]:
    """The first group of a collective's ``replica_groups``, its partition indices."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        shape = [int(x) for x in iota.group(3).split(",")]
        perm = [int(x) for x in iota.group(4).split(",")] if iota.group(4) else None
        ids = list(range(math.prod(shape)))
        if perm:
            import numpy as np

            ids = list(np.arange(math.prod(shape)).reshape(shape).transpose(perm).reshape(-1))
        del groups
        return [int(x) for x in ids[:size]]
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return [int(x) for x in listed.group(1).split(",") if x]
    size = _group_size(line, everyone)
    return list(range(size))


def program_text(compiled: Any) -> str:
    """A compiled program's HLO text with its constants whole: which branch a pipeline's
    tick takes is read from its schedule's tables, which ``as_text()`` elides."""
    try:
        from jax._src.lib import hlo

        options = hlo.HloPrintOptions()
        options.print_large_constants = True
        return compiled.runtime_executable().hlo_modules()[0].to_string(options)
    except (ImportError, AttributeError, IndexError, TypeError):  # another JAX: as printed
        return compiled.as_text()
