"""pp's checks of a compiled program: what XLA made of a written schedule that could wait
forever. A written schedule runs different passes on different stages at once; a send the
compiler put inside a pass, or a collective it put between the passes of a tick, could meet
pp's sends in another order on each device. Read from the program's structure: a stage's
pass is a conditional whose predicate differs between devices (:class:`Varying`), pp's sends
conditionals every device takes alike."""

from __future__ import annotations

import re
from typing import Any

from shardplug.plugin import Varying, computations, reached, source_of


def divergent_permutes(hlo: str) -> list[str]:
    """The collective-permutes of a compiled program (its HLO text) inside a pass a stage
    chooses alone (a conditional whose predicate differs between devices), each as the
    model's operation it came from: the compiler's sends between devices (a slice or shift
    of an array split over an axis), which wait for every device of the mesh while the other
    stages run another pass. pp's own sends are conditionals every device takes alike."""
    program = computations(hlo)
    return [_named(hlo, i) for _, cond in Varying(program).divergent()
            for _, branch in cond.calls for i in reached(program, branch)
            if i.opcode.startswith("collective-permute")]  # fmt: skip


def unordered_collectives(hlo: str) -> list[str]:
    """The collectives of a compiled program (its HLO text) that the compiler put in the
    tick loop (the computation that runs the passes a stage chooses alone) outside every
    conditional (pp's passes and sends are each one): moves of the model's arrays between
    one layout and another of its buffers (an all-gather over ``context`` where a pass's
    activations and the buffer holding them disagree). Nothing orders them against pp's
    sends by data, and XLA:CPU runs what does not wait on each other in any order, each
    device its own: a device that sends first waits for every device while its stage's
    others wait for it in the all-gather."""
    program = computations(hlo)
    ticks = {c for c, _ in Varying(program).divergent()}
    return [i.opcode.removesuffix("-start") for c in ticks
            for i in reached(program, c, lambda i: i.opcode != "conditional")
            if i.opcode.removesuffix("-start") in _KINDS]  # fmt: skip


_KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _named(hlo: str, instruction: Any) -> str:
    """The model's operation an instruction came from, and where: as its metadata names it
    (the last part of its ``op_name``), at the line of code that made it."""
    name = re.search(r'op_name="([^"]*)"', instruction.text)
    op = name.group(1).rsplit("/", 1)[-1] if name else "operation"
    where = source_of(hlo, instruction)
    return f"{op} at {where}" if where else op
