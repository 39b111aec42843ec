"""Which branch a conditional takes, read from the program: a pipeline's tick picks each
stage's pass by its schedule's tables, indexed by the tick (the loop's induction variable)
and the stage (the device's own index). The scalar arithmetic that picks it is evaluated
here, per iteration and device, so that a predicted step takes the branches the GPU would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from shardplug.core.compiled.hlo import Instruction
from shardplug.core.compiled.program import Program, result


@dataclasses.dataclass(frozen=True)
class Loop:
    """One iteration of a while loop: its body, the tuple index of its induction variable,
    and that variable's value."""

    body: str
    index: int
    value: int


class _Unknown(Exception):
    """A value the program computes from what a prediction does not know."""


class Evaluator:
    """The scalar arithmetic a conditional's branch index is computed by: the loop's
    induction variable, the device's own index, constants (a schedule's tables) and what
    integer arithmetic, comparison, selection and slicing make of them."""

    def __init__(self, program: Program, loop: Loop | None, device: int):
        self.program, self.loop, self.device = program, loop, device
        self.memo: dict[tuple[str, str], Any] = {}

    def branch(self, computation: str, i: Instruction) -> int | None:
        try:
            value = self.value(computation, i.operands[0], {})
        except (_Unknown, KeyError, IndexError, ValueError, TypeError):
            return None
        import numpy as np

        value = np.asarray(value)
        if value.size != 1:
            return None
        if value.dtype == np.bool_:  # true_computation first
            return 0 if bool(value) else 1
        return max(int(value), 0)

    def value(self, computation: str, name: str, env: dict[int, Any]) -> Any:
        key = (computation, name)
        if not env and key in self.memo:
            return self.memo[key]
        i = self.program.defs[computation].get(name)
        if i is None:
            raise _Unknown(name)
        out = self._eval(computation, i, env)
        if not env:
            self.memo[key] = out
        return out

    def _eval(self, c: str, i: Instruction, env: dict[int, Any]) -> Any:
        import numpy as np

        op, args = i.opcode, i.operands
        shape = result(i)

        def arg(k: int) -> Any:
            return self.value(c, args[k], env)

        if op == "parameter":
            k = int(re.search(r"parameter\((\d+)\)", i.text).group(1))
            if k in env:
                return env[k]
            raise _Unknown(i.name)
        if op == "get-tuple-element":
            k = int(re.search(r"index=(\d+)", i.text).group(1))
            source = self.program.defs[c].get(args[0])
            if (source is not None and source.opcode == "parameter" and self.loop is not None
                    and c == self.loop.body and k == self.loop.index):  # fmt: skip
                return np.int64(self.loop.value)
            if source is not None and source.opcode == "tuple":
                return self.value(c, source.operands[k], env)
            found = self.value(c, args[0], env)
            if isinstance(found, tuple):
                return found[k]
            raise _Unknown(i.name)
        if op in ("partition-id", "replica-id"):
            return np.uint32(self.device)
        if op == "constant":
            return _literal(i.text, shape)
        if op in ("fusion", "fusion-done", "call"):
            start = self.program.defs[c].get(args[0]) if op == "fusion-done" else i
            if start is None:
                raise _Unknown(i.name)
            callee = next((n for r, n in start.calls if r in ("calls", "to_apply")), None)
            root = next((x for x in self.program.computations.get(callee or "", []) if x.root),
                        None)  # fmt: skip
            if root is None:
                raise _Unknown(i.name)
            operands = start.operands
            inner = _LazyEnv(lambda k: self.value(c, operands[k], env))
            return self.value(callee, root.name, inner)
        if op == "tuple":
            return tuple(arg(k) for k in range(len(args)))
        dtype = _NUMPY.get(shape[0][0]) if shape else None
        dims = shape[0][1] if shape else ()
        if op in ("bitcast", "reshape", "copy"):
            return np.reshape(arg(0), dims)
        if op == "convert":
            return np.asarray(arg(0)).astype(dtype)
        if op == "broadcast":
            x = np.asarray(arg(0))
            found = re.search(r"dimensions=\{([\d,]*)\}", i.text)
            keep = [int(d) for d in found.group(1).split(",") if d] if found else []
            view = [1] * len(dims)
            for d, n in zip(keep, x.shape, strict=False):
                view[d] = n
            return np.broadcast_to(x.reshape(view), dims)
        if op == "iota":
            axis = int(re.search(r"iota_dimension=(\d+)", i.text).group(1))
            view = [1] * len(dims)
            view[axis] = dims[axis]
            return np.broadcast_to(np.arange(dims[axis]).reshape(view), dims).astype(dtype)
        if op in _BINARY:
            return _BINARY[op](np, arg(0), arg(1)).astype(dtype)
        if op in ("not", "negate", "abs"):
            x = arg(0)
            return {"not": np.logical_not if dtype is bool else np.invert,
                    "negate": np.negative, "abs": np.abs}[op](x)  # fmt: skip
        if op == "compare":
            direction = re.search(r"direction=(\w+)", i.text).group(1)
            return _COMPARE[direction](np.asarray(arg(0)), np.asarray(arg(1)))
        if op == "select":
            return np.where(arg(0), arg(1), arg(2)).astype(dtype)
        if op == "clamp":
            return np.clip(arg(1), arg(0), arg(2)).astype(dtype)
        if op == "dynamic-slice":
            x = np.asarray(arg(0))
            sizes = [int(d) for d in
                     re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", i.text).group(1).split(",")
                     if d]  # fmt: skip
            starts = [int(np.clip(int(arg(k + 1)), 0, x.shape[k] - sizes[k]))
                      for k in range(x.ndim)]  # fmt: skip
            return x[tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))]
        if op == "slice":
            x = np.asarray(arg(0))
            bounds = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", i.text.split("slice={", 1)[-1])
            return x[tuple(slice(int(a), int(b), int(s or 1)) for a, b, s in bounds)]
        if op == "concatenate":
            axis = int(re.search(r"dimensions=\{(\d+)\}", i.text).group(1))
            return np.concatenate([np.asarray(arg(k)) for k in range(len(args))], axis=axis)
        raise _Unknown(op)


class _LazyEnv(dict):
    """A fused computation's parameters, each evaluated when first read."""

    def __init__(self, get: Any):
        super().__init__()
        self.get_value = get

    def __contains__(self, k: object) -> bool:
        return isinstance(k, int)

    def __missing__(self, k: int) -> Any:
        self[k] = self.get_value(k)
        return self[k]

    def __bool__(self) -> bool:
        return True


_NUMPY = {"pred": bool, "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
          "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
          "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "float32"}  # fmt: skip
_BINARY = {
    "add": lambda np, a, b: np.add(a, b),
    "subtract": lambda np, a, b: np.subtract(a, b),
    "multiply": lambda np, a, b: np.multiply(a, b),
    "divide": lambda np, a, b: (np.trunc(np.divide(a, b)) if np.asarray(a).dtype.kind in "iu"
                                else np.divide(a, b)),
    "remainder": lambda np, a, b: np.fmod(a, b),
    "maximum": lambda np, a, b: np.maximum(a, b),
    "minimum": lambda np, a, b: np.minimum(a, b),
    "and": lambda np, a, b: np.logical_and(a, b) if np.asarray(a).dtype == bool else a & b,
    "or": lambda np, a, b: np.logical_or(a, b) if np.asarray(a).dtype == bool else a | b,
    "xor": lambda np, a, b: np.logical_xor(a, b) if np.asarray(a).dtype == bool else a ^ b,
    "shift-left": lambda np, a, b: np.left_shift(a, b),
    "shift-right-logical": lambda np, a, b: np.right_shift(a, b),
}  # fmt: skip
_COMPARE = {
    "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b, "LT": lambda a, b: a < b,
    "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b,
}  # fmt: skip


def _literal(text: str, shape: list[tuple[str, tuple[int, ...]]]) -> Any:
    """A constant's value from its HLO text (``constant({...})`` elides large ones: a
    program printed with them is needed, :func:`program_text`)."""
    import numpy as np

    body = text.split("constant(", 1)[1]
    depth, end = 1, 0
    while end < len(body) and depth:
        depth += {"(": 1, ")": -1}.get(body[end], 0)
        end += 1
    body = body[: end - 1]
    if "..." in body:
        raise _Unknown("an elided constant")
    words = re.findall(r"true|false|-?inf|nan|-?[\d.]+(?:e[-+]?\d+)?", body)
    values = [1 if w == "true" else 0 if w == "false" else float(w) for w in words]
    dtype, dims = shape[0] if shape else ("f32", ())
    array = np.array(values, dtype=np.float64)
    if array.size != math.prod(dims):
        raise _Unknown("a constant of another size")
    return array.reshape(dims).astype(_NUMPY.get(dtype, "float64"))
