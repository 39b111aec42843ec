"""What a device computes and moves a second: the figures a step's time is predicted from.

A GPU's are published (its dense tensor-core peaks, its memory's and links' bandwidth, its
cores) plus what real kernels reach of them: a large tuned GEMM's share of the peak, a
streaming kernel's share of the bandwidth (:data:`CALIBRATION`, fitted to H100 measurements;
benchmarks/gpu/h100_target_time.json holds the fit and the points kept out of it), flash
attention's share at its published speed, and what a kernel and a loop's iteration cost
beyond their work. A CPU's are measured on the machine (``benchmarks/cpu_time.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: the tiles a tuned GEMM library chooses from (rows x columns of the output per core), and
#: what each reaches of the largest's throughput: a smaller tile reuses each operand it
#: loads over fewer products (Hopper's cuBLAS and Triton's tuned configurations)
TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.92), (64, 256, 0.85),
         (64, 128, 0.78), (64, 64, 0.6))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Chip:
    """What one device computes and moves, as a prediction reads it.

    ``flops`` is the dense peak of matrix products by operand dtype (``bf16``, ``f16``,
    ``f8``, ``f32``: float32 products run as TF32 on NVIDIA's tensor cores by default,
    ``f64``, ``s8``); ``vector`` the element-wise operations a second, ``special`` the
    transcendental functions a second; ``bandwidth`` the memory's bytes a second; ``links``
    each link's bytes a second one way per device (``local``: inside a host of
    ``per_host``, ``network``: between hosts), ``pcie`` the host link's. ``cores`` is what a
    product's tiles run in waves over (0: no waves, a CPU's). The efficiencies are the share
    of a peak real kernels reach."""

    name: str
    flops: Mapping[str, float]
    vector: float
    special: float
    bandwidth: float
    links: Mapping[str, float]
    pcie: float
    cores: int = 0
    per_host: int = 8
    #: a collective's latency over each link, whatever its bytes (NCCL's small all-reduce of
    #: 8 GPUs: about 10 us on NVLink, 25 us between hosts over InfiniBand)
    latency: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"local": 10e-6, "network": 25e-6}
    )
    #: what a kernel costs beyond its work (its launch, and its ramp up and down)
    launch_seconds: float = 2e-6
    #: what each iteration of a loop, or a conditional, costs beyond its kernels (the
    #: predicate read back by the host)
    loop_seconds: float = 5e-6
    #: a large tuned GEMM's share of the peak
    gemm_efficiency: float = 0.8
    #: a streaming kernel's share of the memory's bandwidth
    memory_efficiency: float = 0.85
    #: flash attention's share of the bf16 peak, forward and backward (FlashAttention-3 and
    #: cuDNN 9 on an H100 at head dimension 64-128: about 450 and 350 TFLOP/s)
    attention_efficiency: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"forward": 0.45, "backward": 0.35}
    )
    #: how many devices share this chip's cores (simulated CPU devices on one machine): each
    #: kernel and loop iteration takes that many times as long (the devices' programs take
    #: turns), a collective's wait does not
    shared_by: int = 1

    def peak(self, kind: str = "bf16") -> float:
        """The dense peak of matrix products of operands ``kind``, FLOP/s."""
        return self.flops.get(kind, self.flops.get("f32", 0.0))


_HOPPER = {
    "flops": {"bf16": 989.4e12, "f16": 989.4e12, "f8": 1978.9e12, "f32": 494.7e12,
              "f64": 66.9e12, "s8": 1978.9e12},
    "vector": 66.9e12, "special": 132 * 16 * 1.98e9, "cores": 132,
    "links": {"local": 450e9, "network": 50e9}, "pcie": 64e9,
}  # fmt: skip

#: the GPUs ``--target`` compiles for, with their published figures: dense tensor-core peaks
#: (H100 SXM: 989.4 TFLOP/s bf16, 1979 float8), HBM (H100 3.35 TB/s, H200 4.8 TB/s, A100
#: 2.04 TB/s), NVLink (H100/H200: NVLink 4, 450 GB/s each way; A100: NVLink 3, 300 GB/s),
#: 400 Gb/s of InfiniBand per GPU between hosts (200 Gb/s on A100), PCIe Gen5 x16 (Gen4 on
#: A100)
CHIPS = {
    "h100": Chip("h100", bandwidth=3.35e12, **_HOPPER),
    "h200": Chip("h200", bandwidth=4.8e12, **_HOPPER),
    "a100": Chip("a100", flops={"bf16": 312e12, "f16": 312e12, "f32": 156e12, "f64": 19.5e12,
                                "s8": 624e12},
                 vector=19.5e12, special=108 * 16 * 1.41e9, bandwidth=2.039e12, cores=108,
                 links={"local": 300e9, "network": 25e9}, pcie=32e9),
}  # fmt: skip

#: the constants fitted to an H100's step times (``python benchmarks/target_time.py``, which
#: solves each on one point and checks every other: benchmarks/gpu/h100_target_time.json).
#: The H200 shares the H100's cores; the A100's are taken as the H100's, unchecked.
CALIBRATION: dict[str, float] = {"gemm_efficiency": 0.761, "memory_efficiency": 0.8187}


def calibrated(name: str) -> Chip:
    """The chip called ``name`` (``h100``, ``h200``, ``a100``), its fitted constants set."""
    return dataclasses.replace(CHIPS[name], **CALIBRATION)


def chip_of(device: Any) -> Chip | None:
    """The calibrated :class:`Chip` of a GPU ``--target`` compiles for, by its kind (a
    compile-only device, or one present); None for any other device."""
    from shardplug.core.compiled.targets import TARGETS

    kind = getattr(device, "device_kind", None)
    name = next((n for n, t in TARGETS.items() if t.kind == kind), None)
    return calibrated(name) if name in CHIPS else None
