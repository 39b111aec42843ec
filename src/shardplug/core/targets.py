"""GPUs a step can be compiled for on a machine without them: ``explain --target h100``.

JAX compiles for a GPU that is not present through its CUDA plugin's compile-only devices
(``jax.experimental.topologies``), given the GPU's description as XLA's GPU compiler reads it
(a ``GpuTargetConfig`` text proto). The program is the one the GPU would run, scheduled by
the GPU compiler, host copies included, so its memory analysis is the GPU's: its arguments,
outputs and temporaries, not XLA:CPU's one memory. Autotuning is off without a GPU (the
compiler's default kernels), and the plugin's compile-only devices exist only where JAX
runs on the CPU platform alone (``JAX_PLATFORMS=cpu``, set before JAX starts: the command
line sets it for ``--target``).

The plugin (``jax-cuda12-plugin`` at JAX's version, about 470 MB) needs no GPU and no CUDA
library: ``pip install 'shardplug[target]'``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardplug.core.devices import is_compile_only
from shardplug.errors import ConfigError

#: what installs the compiler of the GPUs
INSTALL = "pip install 'shardplug[target]' (JAX's CUDA plugin, about 470 MB; no GPU needed)"


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to compile for: its name on the command line, the name CUDA gives it, and the
    figures XLA's GPU compiler plans with (its memory in bytes, as CUDA reports it)."""

    name: str
    kind: str
    memory_bytes: int
    cores: int
    capability: int
    bandwidth: int  # bytes per second
    l2_bytes: int
    clock_ghz: float
    shared_per_core: int
    shared_per_block_optin: int
    fpus_per_core: int

    def config(self) -> str:
        """The GPU as XLA's ``GpuTargetConfig`` text proto."""
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_per_core}
  threads_per_core_limit: 2048
  core_count: {self.cores}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.bandwidth}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  cuda_compute_capability {{ major: {self.capability} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.kind}"
"""


_HOPPER = {"cores": 132, "capability": 9, "l2_bytes": 52428800, "clock_ghz": 1.98,
           "shared_per_core": 233472, "shared_per_block_optin": 232448, "fpus_per_core": 128}
TARGETS = {
    "h100": Target("h100", "NVIDIA H100 80GB HBM3", 84978434048, bandwidth=3352320000000,
                   **_HOPPER),
    "h200": Target("h200", "NVIDIA H200", 150754820096, bandwidth=4800000000000, **_HOPPER),
    "a100": Target("a100", "NVIDIA A100-SXM4-80GB", 85100068864, cores=108, capability=8,
                   bandwidth=2039040000000, l2_bytes=41943040, clock_ghz=1.41,
                   shared_per_core=167936, shared_per_block_optin=166912, fpus_per_core=64),
}  # fmt: skip

#: the GPUs one host holds in the compiled topology (more make more hosts)
PER_HOST = 8


def find_target(name: str) -> Target:
    """The :class:`Target` called ``name`` (``h100``, ``h200``, ``a100``)."""
    try:
        return TARGETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"--target {name}: not a GPU shardplug compiles for; choose one of "
            f"{', '.join(TARGETS)}"
        ) from None


def on_cpu_alone() -> None:
    """JAX on the CPU platform alone, where its CUDA plugin compiles for GPUs not here: what
    ``JAX_PLATFORMS=cpu`` does, said before JAX starts its backends (else nothing)."""
    import contextlib
    import os

    import jax

    os.environ["JAX_PLATFORMS"] = "cpu"
    with contextlib.suppress(RuntimeError):  # backends already started: target_devices says
        jax.config.update("jax_platforms", "cpu")


def target_devices(name: str, count: int = 1) -> list[Any]:
    """``count`` compile-only devices of the GPU ``name``, for ``Trainer(devices=...,
    allocate=False)`` and :func:`shardplug.explain`: the step compiled as that GPU would
    run it. Needs JAX's CUDA plugin and JAX on the CPU platform alone (module docs)."""
    import jax

    target = find_target(name)
    if count < 1:
        raise ConfigError(f"--devices {count}: compile for at least one {target.name}")
    if (jax.config.jax_platforms or "").strip().lower() != "cpu":
        raise ConfigError(
            f"--target {target.name} compiles on the CPU for a GPU that is not here, and needs "
            "JAX on the CPU platform alone: set JAX_PLATFORMS=cpu before JAX starts (the "
            "command line does)"
        )
    from jax.experimental import topologies

    hosts = math.ceil(count / PER_HOST)
    per_host = min(count, PER_HOST)
    if hosts * per_host != count:
        raise ConfigError(
            f"--devices {count}: more than {PER_HOST} GPUs are compiled for as whole hosts of "
            f"{PER_HOST}; ask for a multiple of {PER_HOST}"
        )
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{per_host}", target_config=target.config()
        )
    except NotImplementedError:  # no CUDA plugin registered a compiler
        raise ConfigError(
            f"--target {target.name} needs JAX's CUDA plugin to compile for the GPU: {INSTALL}"
        ) from None
    return list(topology.devices)


def memory_of(device: Any) -> int | None:
    """The memory of a compile-only device's GPU (None for any other device)."""
    kind = getattr(device, "device_kind", None)
    return next((t.memory_bytes for t in TARGETS.values() if t.kind == kind), None)


def compile_noting(trainer: Any, batch: Any) -> list[str]:
    """``trainer.compile(batch)``; for compile-only devices, what the report of that program
    must say: the GPU it is compiled for, and XLA's attention where shardplug's fused
    attention could not compile as cuDNN's. Refused where the GPU's program cannot be what
    the run holds: state or activations in host memory, which compile-only devices lack."""
    from shardplug.core.fallbacks import NAME as FALLBACKS
    from shardplug.core.memory import activations_on_host, any_off

    device = trainer.mesh.devices.flat[0]
    if not is_compile_only(device):
        trainer.compile(batch)
        return []
    # JAX drops the memory kind of a compile-only device's sharding: ask who places state
    places = [i for i in trainer.strategy.pm.hook.place_state.get_hookimpls()
              if i.plugin_name != FALLBACKS]  # fmt: skip
    if places or any_off(trainer.state_shardings):
        raise ConfigError(_NO_HOST.format(device.device_kind))
    from shardplug.core.attention import REFUSED

    refused = len(REFUSED)
    trainer.compile(batch)
    if activations_on_host(trainer.jaxpr):
        raise ConfigError(_NO_HOST.format(device.device_kind))
    count = len(trainer.mesh.devices.flat)
    notes = [f"compiled for {count} x {device.device_kind}, not present: the GPU compiler's "
             "program and memory, its kernels untuned (no GPU to time them)"]  # fmt: skip
    if len(REFUSED) > refused:
        notes.append(
            f"attention compiled as XLA's, not as cuDNN's fused kernel ({REFUSED[-1]}): the "
            "temporaries count attention scores that kernel never holds, so the peak is high"
        )
    return notes


_NO_HOST = (
    "--target compiles for a {} that is not here, whose devices have no host memory to "
    "compile offload's or --remat offload's copies for yet: explain it without --target "
    "(the CPU's figures)"
)
