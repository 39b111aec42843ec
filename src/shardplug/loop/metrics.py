"""What each logged row says about the hardware: FLOP/s, MFU, memory, communication.

Read once per compiled step (:class:`StepFacts`) and per logged window (:func:`device_rows`):

- ``step_tflops``: the step's FLOPs (:func:`shardplug.core.flops.step_flops`, every matrix
  product the traced step runs, loops and recomputation counted) per second, all devices;
- ``model_tflops``: the model's FLOPs by the textbook count (a task's ``flops_per_sample``)
  per second, or without one 3 x its forward pass's matrix products traced on no strategy
  (:func:`shardplug.core.flops.model_flops`: one count for one model and batch under every
  strategy, where the step's counts a pipeline's extra work); ``mfu``: that over the
  devices' peak (known accelerators' bfloat16 peak, or ``peak_tflops`` given);
- ``memory_in_use`` and ``memory_peak``: bytes on the fullest device, from the backend's
  memory statistics where it keeps them (GPU, TPU), else from the compiled step's memory
  analysis (its resident arguments, and arguments + outputs + temporaries);
- ``comm_share``: the share of the step's bytes that are communication: bytes each device
  sends in collectives (ring algorithms, :mod:`shardplug.core.compiled.hlo`) over those plus the
  bytes it reads and writes in memory (XLA's cost analysis, scaled up by the factor XLA's
  count of FLOPs falls short of the step's, since XLA counts a loop's body once).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from shardplug.core.compiled.hlo import collectives
from shardplug.core.flops import step_flops
from shardplug.core.memory import entry_bytes, peak_bytes

#: dense bfloat16 peak TFLOP/s per device, by a substring of ``device.device_kind``
PEAK_TFLOPS = {
    "H200": 989.4, "H100": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0,
    "L40S": 362.0, "L4": 121.0, "A10G": 70.0,
    "TPU v6": 918.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v4": 275.0,
}  # fmt: skip


def peak_tflops(device: Any) -> float | None:
    """A device's dense bfloat16 peak from :data:`PEAK_TFLOPS`, None when unknown (CPU)."""
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What the compiled step costs, read once: FLOPs (all devices), the bytes each device
    sends and accesses, and its memory analysis."""

    flops: float
    model_flops: float | None  # the model's per step (Program.model_flops), None: unknown
    sent_bytes: float
    accessed_bytes: float
    argument_bytes: int | None
    peak_bytes: int | None

    @classmethod
    def of(cls, program: Any, devices: int) -> StepFacts:
        flops = step_flops(program.jaxpr)
        cost = program.compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
        xla_flops = float(cost.get("flops", 0.0))
        scale = max(1.0, flops / devices / xla_flops) if xla_flops > 0 else 1.0
        sent = sum(c.wire_bytes for c in collectives(program.compiled.as_text()))
        analysis = program.compiled.memory_analysis()
        argument = getattr(analysis, "argument_size_in_bytes", None)
        text = program.compiled.as_text()
        if argument is not None and not getattr(analysis, "host_argument_size_in_bytes", 0):
            argument -= entry_bytes(text)["arguments"]["host"]  # the device's own (offload)
        peak = None if analysis is None else peak_bytes(analysis, text)
        return cls(flops, program.model_flops, float(sent),
                   float(cost.get("bytes accessed", 0.0)) * scale, argument, peak)  # fmt: skip

    @property
    def comm_share(self) -> float:
        total = self.sent_bytes + self.accessed_bytes
        return self.sent_bytes / total if total > 0 else 0.0


def device_rows(
    facts: StepFacts,
    step_time: float,
    samples_per_sec: float,
    *,
    devices: list[Any],
    flops_per_sample: float | None,
    peak: float | None,
) -> dict[str, float]:
    """The hardware columns of a logged row, for a window whose steps took ``step_time``."""
    row: dict[str, float] = {}
    if step_time > 0 and math.isfinite(step_time):
        row["step_tflops"] = facts.flops / step_time / 1e12
        if flops_per_sample:
            model = flops_per_sample * samples_per_sec / 1e12
        elif facts.model_flops:
            model = facts.model_flops / step_time / 1e12
        else:
            model = row["step_tflops"]
        row["model_tflops"] = model
        if peak:
            row["mfu"] = model / (peak * len(devices))
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    stats = [s for s in stats if s and "bytes_in_use" in s]
    if stats:
        row["memory_in_use"] = float(max(s["bytes_in_use"] for s in stats))
        row["memory_peak"] = float(max(s.get("peak_bytes_in_use", 0) for s in stats))
    elif facts.peak_bytes is not None:
        row["memory_in_use"] = float(facts.argument_bytes)
        row["memory_peak"] = float(facts.peak_bytes)
    row["comm_share"] = facts.comm_share
    return row
