"""Each kernel's time in a compiled program, from its own FLOPs and bytes: the per-kernel
part of a predicted step (:mod:`shardplug.core.compiled.timing`, which puts kernels on a schedule).

A matrix product is timed as the tuned kernel a GPU would pick for its shape (the tile that
finishes first, in waves over the cores), fused attention at flash attention's published
efficiency, and every other kernel by the bytes it reads and writes (a slice reads its
slice, an in-place update writes its update) or its element-wise arithmetic, whichever is
longer; each kernel pays its launch on top.
"""

from __future__ import annotations

import collections
import functools
import math
import re

from shardplug.core.compiled.chips import TILES, Chip
from shardplug.core.compiled.hlo import Instruction
from shardplug.core.compiled.program import Program, result
from shardplug.core.compiled.program import nbytes as size_of

#: a Pallas flash kernel lowered to Triton (jax.experimental.pallas.ops.gpu.attention's, or
#: shardplug's pair kernel for a ring's blocks), by its kernel's name
_FLASH = re.compile(r"^(mha_forward|mha_backward|shardplug_pair_)")
#: the products of each pass of fused attention, by the kernel's name
_PRODUCTS = (("Backward|mha_backward", 5), ("pair_dkv", 4), ("pair_dq", 3))
#: what a Triton flash kernel reaches of cuDNN's: FlashAttention-2 against FlashAttention-3
#: on an H100 at head dimension 64-128 (the FA3 paper: about 335 against 540 TFLOP/s)
TRITON_SHARE = 0.62
#: a kernel's part of the step, its FLOPs, bytes and seconds
Cost = tuple[str, float, float, float]
#: what costs nothing on its own: names, tuples, views, a device's index
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
        "get-dimension-size", "iota"}  # fmt: skip
_SPECIAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic",
            "rsqrt", "sqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"}  # fmt: skip
_NOT_ARITHMETIC = FREE | {"broadcast", "reshape", "transpose", "slice", "dynamic-slice",
                           "dynamic-update-slice", "concatenate", "pad", "copy", "reverse",
                           "gather", "scatter", "convert", "bitcast-convert", "select",
                           "compare", "reduce", "fusion", "dot"}  # fmt: skip
#: what updates its first operand in place, and which operand holds the update
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
_DIMS = re.compile(r"(lhs|rhs)_(contracting|batch)_dims=\{([\d,]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _parameter_index(i: Instruction) -> int:
    return int(re.search(r"parameter\((\d+)\)", i.text).group(1))


class Kernels:
    """The kernels of one program on one chip, each timed once."""

    def __init__(self, program: Program, chip: Chip):
        self.program, self.chip = program, chip
        self.memo: dict[tuple[str, str], Cost] = {}

    def kernel(self, computation: str, i: Instruction) -> Cost:
        """A kernel's part, FLOPs, bytes and seconds."""
        key = (computation, i.name)
        if key not in self.memo:
            part, flops, moved, seconds = self._kernel(computation, i)
            self.memo[key] = (part, flops, moved, seconds * self.chip.shared_by)
        return self.memo[key]

    def _kernel(self, computation: str, i: Instruction) -> Cost:
        chip = self.chip
        if i.opcode == "custom-call":
            return self._custom(computation, i)
        if i.opcode in ("fusion", "fusion-start"):
            callee = next((c for r, c in i.calls if r == "calls"), "")
            dot = next((d for d in self.program.computations.get(callee, [])
                        if d.opcode in ("dot", "convolution", "scaled-dot")), None)  # fmt: skip
            if dot is not None and "kCustom" in i.text:
                return self._product(callee, dot, computation, i)
            nbytes = self._fusion_bytes(computation, i, callee)
            arithmetic, special = self._arithmetic(callee)
        elif i.opcode in ("dot", "convolution"):
            return self._product(computation, i, computation, i)
        else:
            nbytes = self._plain_bytes(computation, i)
            arithmetic = special = 0.0
        seconds = max(nbytes / (chip.bandwidth * chip.memory_efficiency),
                      arithmetic / chip.vector + special / chip.special)  # fmt: skip
        return "memory-bound", arithmetic, nbytes, seconds + chip.launch_seconds

    def _plain_bytes(self, computation: str, i: Instruction) -> float:
        out = size_of(result(i))
        if i.opcode in ("slice", "dynamic-slice", "gather"):
            return 2 * out
        if i.opcode == "dynamic-update-slice" and len(i.operands) > 1:
            return 2 * size_of(self.program.shape(computation, i.operands[1]))
        return out + self.program.operand_bytes(computation, i)

    @functools.cache  # noqa: B019 (one program, one chip: a Kernels lives as long)
    def _fusion_io(self, callee: str) -> tuple[tuple[float | None, ...], float | None]:
        """For each parameter of a fused computation, the bytes it reads of it (None: the
        whole parameter), and the bytes the fusion writes (None: its whole result)."""
        body = self.program.computations.get(callee, [])
        defs = {i.name: i for i in body}
        users: dict[str, list[Instruction]] = collections.defaultdict(list)
        for i in body:
            for o in i.operands:
                users[o].append(i)

        def read(name: str, depth: int = 0) -> float | None:
            total = 0.0
            for u in users.get(name, []):
                if u.opcode in ("slice", "dynamic-slice", "gather"):
                    total += size_of(result(u))
                elif u.opcode in _IN_PLACE and u.operands[0] == name:
                    continue  # updated in place: not read
                elif u.opcode == "bitcast" and depth < 8:
                    inner = read(u.name, depth + 1)
                    if inner is None:
                        return None
                    total += inner
                else:
                    return None
            return total

        params = sorted((i for i in body if i.opcode == "parameter"), key=_parameter_index)
        reads = tuple(read(p.name) for p in params)
        root = next((i for i in body if i.root), None)
        written: float | None = None
        if root is not None:
            outs = [defs.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
            if any(o is not None and o.opcode in _IN_PLACE for o in outs):
                written = 0.0
                for o in outs:
                    if o is None:
                        continue
                    if o.opcode in _IN_PLACE and len(o.operands) > 1:
                        upd = defs.get(o.operands[_IN_PLACE[o.opcode]])
                        written += size_of(result(upd)) if upd is not None else 0.0
                    else:
                        written += size_of(result(o))
        return reads, written

    def _fusion_bytes(self, computation: str, i: Instruction, callee: str) -> float:
        reads, written = self._fusion_io(callee)
        total = 0.0
        for k, name in enumerate(i.operands):
            whole = size_of(self.program.shape(computation, name))
            part = reads[k] if k < len(reads) else None
            total += whole if part is None else min(part, whole)
        return total + (size_of(result(i)) if written is None else written)

    @functools.cache  # noqa: B019
    def _arithmetic(self, callee: str) -> tuple[float, float]:
        """A fused computation's element-wise operations and transcendental functions."""
        plain = special = 0.0
        for i in self.program.computations.get(callee, []):
            if i.opcode in _NOT_ARITHMETIC:
                continue
            elements = sum(math.prod(s) for _, s in result(i))
            if i.opcode in _SPECIAL:
                special += elements
            else:
                plain += elements
        return plain, special

    def _product(
        self, body: str, dot: Instruction, computation: str, i: Instruction
    ) -> Cost:
        """A matrix product: its FLOPs at the tuned tile's efficiency, or its bytes."""
        lhs = self.program.shape(body, dot.operands[0]) if dot.operands else []
        rhs = self.program.shape(body, dot.operands[1]) if len(dot.operands) > 1 else []
        out = result(dot)
        if not (lhs and rhs and out):
            nbytes = self.program.operand_bytes(computation, i) + size_of(result(i))
            return "memory-bound", 0.0, nbytes, nbytes / self.chip.bandwidth
        dims = {(s, k): [int(x) for x in v.split(",") if x] for s, k, v in _DIMS.findall(dot.text)}
        lshape, rshape = lhs[0][1], rhs[0][1]
        contract = [lshape[d] for d in dims.get(("lhs", "contracting"), [])]
        batch = [lshape[d] for d in dims.get(("lhs", "batch"), [])]
        if dot.opcode == "convolution":  # FLOPs: each output element, the kernel's window
            kernel = math.prod(rshape)
            out_features = rshape[-1] if rshape else 1
            k = kernel // max(out_features, 1)
            m, n, b = math.prod(out[0][1]) // max(out_features, 1), out_features, 1
        else:
            k = math.prod(contract)
            b = math.prod(batch)
            rows = [x for d, x in enumerate(lshape)
                    if d not in dims.get(("lhs", "contracting"), [])
                    and d not in dims.get(("lhs", "batch"), [])]  # fmt: skip
            m = math.prod(rows)
            n = math.prod(out[0][1]) // max(m * b, 1)
        flops = 2.0 * m * n * k * b
        kind = _operand_kind(lhs[0][0], rhs[0][0])
        nbytes = self.program.operand_bytes(computation, i) + size_of(result(i))
        seconds = self.gemm_seconds(m, n, k, b, kind, nbytes)
        return f"matmul {kind}", flops, nbytes, seconds

    def gemm_seconds(self, m: int, n: int, k: int, b: int, kind: str, nbytes: float) -> float:
        """The tuned product's time: the tile that finishes first, its waves over the cores,
        or the bytes over memory, whichever is longer; and a launch."""
        chip = self.chip
        peak = chip.flops.get(kind, chip.flops.get("f32", 1.0)) * chip.gemm_efficiency
        memory = nbytes / (chip.bandwidth * chip.memory_efficiency)
        if not chip.cores:
            return max(2.0 * m * n * k * b / peak, memory) + chip.launch_seconds
        best = math.inf
        for tm, tn, reach in TILES:
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * b
            waves = math.ceil(tiles / chip.cores)
            # a wave of tiles takes one tile's product at the tile's throughput per core
            per_tile = 2.0 * tm * tn * k / (peak * reach / chip.cores)
            best = min(best, waves * per_tile)
        return max(best, memory) + chip.launch_seconds

    def host_slice_bytes(self, computation: str, i: Instruction, to_device: bool) -> float:
        """What a slice between host and device memory moves over PCIe: the slice read out
        of host memory, or the update written into it."""
        if to_device:
            return float(size_of(result(i)))
        callee = next((c for r, c in i.calls if r == "calls"), "")
        _, written = self._fusion_io(callee)
        return float(size_of(result(i)) if written is None else written)

    def _custom(self, computation: str, i: Instruction) -> Cost:
        target = _TARGET.search(i.text)
        name = target.group(1) if target else ""
        nbytes = self.program.operand_bytes(computation, i) + size_of(result(i))
        if "fmha" in name or "flash" in name:
            return self._attention(computation, i, name, nbytes)
        kernel = re.search(r'\bname = "([^"]+)"', i.text) if "triton" in name else None
        if kernel is not None and _FLASH.search(kernel.group(1)):  # a Pallas flash kernel
            return self._attention(computation, i, kernel.group(1), nbytes, TRITON_SHARE)
        if "gemm" in name or "matmul" in name:
            lhs = self.program.shape(computation, i.operands[0]) if i.operands else []
            rhs = self.program.shape(computation, i.operands[1]) if len(i.operands) > 1 else []
            out = result(i)
            if lhs and rhs and out:
                k = _contracting(i.text, lhs[0][1])
                b = _batch(i.text, lhs[0][1])
                mn = math.prod(out[0][1]) // max(b, 1)
                m = math.prod(lhs[0][1]) // max(k * b, 1)
                n = max(mn // max(m, 1), 1)
                kind = _operand_kind(lhs[0][0], rhs[0][0])
                flops = 2.0 * m * n * k * b
                return f"matmul {kind}", flops, nbytes, self.gemm_seconds(m, n, k, b, kind, nbytes)
        seconds = nbytes / (self.chip.bandwidth * self.chip.memory_efficiency)
        return "memory-bound", 0.0, nbytes, seconds + self.chip.launch_seconds

    def _attention(
        self, computation: str, i: Instruction, name: str, nbytes: float, share: float = 1.0
    ) -> Cost:
        """Fused attention: queries (B, S, H, D) against keys (B, T, H', D), 2 products
        forward and 5 backward (a pass of a split backward: its own share of them), halved
        where causal (cuDNN says so; a Pallas kernel of queries as long as its keys is taken
        to be), at ``share`` of cuDNN's efficiency."""
        q = self.program.shape(computation, i.operands[0]) if i.operands else []
        k = self.program.shape(computation, i.operands[1]) if len(i.operands) > 1 else []
        if not (q and k) or len(q[0][1]) != 4:
            seconds = nbytes / (self.chip.bandwidth * self.chip.memory_efficiency)
            return "memory-bound", 0.0, nbytes, seconds + self.chip.launch_seconds
        bsz, s, h, d = q[0][1]
        t = k[0][1][1]
        cudnn = '"mask_type": "CAUSAL"' in i.text or "PADDING_CAUSAL" in i.text
        causal = 0.5 if cudnn or (share != 1.0 and s == t) else 1.0
        products = next((n for pattern, n in _PRODUCTS if re.search(pattern, name)), 2)
        backward = products > 2
        flops = 2.0 * products * bsz * h * s * t * d * causal
        efficiency = self.chip.attention_efficiency["backward" if backward else "forward"]
        peak = self.chip.flops.get("bf16", 1.0) * efficiency * share
        seconds = max(flops / peak, nbytes / (self.chip.bandwidth * self.chip.memory_efficiency))
        return "attention", flops, nbytes, seconds + self.chip.launch_seconds

def _contracting(text: str, lhs: tuple[int, ...]) -> int:
    found = re.search(r'"lhs_contracting_dimensions":\["?([\d",]*)\]', text)
    if not found:
        return lhs[-1] if lhs else 1
    return math.prod(lhs[int(d)] for d in found.group(1).replace('"', "").split(",") if d)


def _batch(text: str, lhs: tuple[int, ...]) -> int:
    found = re.search(r'"lhs_batch_dimensions":\["?([\d",]*)\]', text)
    if not found:
        return 1
    return math.prod(lhs[int(d)] for d in found.group(1).replace('"', "").split(",") if d)


def _operand_kind(a: str, b: str) -> str:
    kinds = {x[:2] if x.startswith("f8") else x for x in (a, b)}
    if "f8" in kinds:
        return "f8"
    for kind in ("f64", "f32", "bf16", "f16", "s8"):
        if kind in kinds:
            return kind
    return "f32"
