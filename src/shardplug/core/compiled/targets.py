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

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Iterator
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
    allocate=False)`` and :func:`shardplug.planning.explain`: the step compiled as that GPU would
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
    attention could not compile as cuDNN's. The optimizer's update on the host
    (``offload``'s ``update=host``) is refused there: the GPU compiler of JAX up to 0.12
    fails on its host computation without a GPU."""
    device = trainer.mesh.devices.flat[0]
    if not is_compile_only(device):
        trainer.compile(batch)
        return []
    if trainer.strategy.update_memory(trainer.state_shardings, trainer.mesh) == "host":
        raise ConfigError(_NO_HOST.format(device.device_kind))
    from shardplug.core.memory import activations_on_host
    from shardplug.core.operations.attention import REFUSED

    refused = len(REFUSED)
    with as_present(device):
        trainer.compile(batch)
    count = len(trainer.mesh.devices.flat)
    notes = [f"compiled for {count} x {device.device_kind}, not present: the GPU compiler's "
             "program and memory; its kernels untuned here, the step's time predicted for "
             "the kernels a GPU tunes"]  # fmt: skip
    text = trainer.compiled.as_text()
    copies, overlapping, first = host_copies(text)
    written, read = host_slices(text)
    if activations_on_host(trainer.jaxpr):
        if not (copies or written):  # the policy's moves were dropped
            raise ConfigError(_NO_REMAT.format(device.device_kind))
        how = (f"{written} slice write(s) and {read} read(s) in the layer loops' bodies"
               if written else "copies")  # one layer: a copy each way
        notes.append(
            f"--remat offload: the GPU's program writes each layer's input to host memory and "
            f"reads it back for the backward pass, over PCIe ({how})"
        )
    if copies:
        notes.append(
            f"the GPU's program brings host memory to the device in {copies} copies, "
            f"{overlapping} of them while the backward pass runs (before its last matrix "
            f"product), the first {first:.0%} of the way through its schedule"
        )
    if len(REFUSED) > refused:
        notes.append(
            f"attention compiled as XLA's, not as a fused kernel ({REFUSED[-1]}): the "
            "temporaries count attention scores that kernel never holds, so the peak is high"
        )
    return notes


#: the cuDNN a GPU run has (the CUDA plugin's floor: jax-cuda12-plugin[with-cuda] 0.12)
CUDNN = 91002


@contextlib.contextmanager
def as_present(device: Any) -> Iterator[None]:
    """Within: JAX's cuDNN attention lowers for ``device``'s GPU (compile-only) as it would
    with the GPU present. Its checks ask the cuDNN library for its version and the first
    local GPU for its compute capability, neither of which a CPU machine has; they answer
    here for the GPU compiled for and the cuDNN its run would load (:data:`CUDNN`). XLA
    compiles cuDNN's kernel as a custom call without the library. A JAX whose checks have
    other names lowers XLA's attention in its place, said in the report.

    What compiles within is kept out of JAX's persistent compilation cache: JAX writes a
    program for a compile-only device to it and fails to load it back, so the same program
    compiled twice with a cache directory set would fail the second time."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from shardplug.core.cache import uncached

    target = next((t for t in TARGETS.values() if t.kind == device.device_kind), None)
    names = ("check_cudnn_version", "check_compute_capability",
             "is_cuda_compute_capability_equal")  # fmt: skip
    with contextlib.ExitStack() as undo:  # every patch undone, whatever ends the compile
        if is_compile_only(device) and jax.config.jax_compilation_cache_dir:
            undo.enter_context(uncached())
        if target is None or not all(hasattr(fused, n) for n in names):
            yield
            return
        have = (target.capability, 0)

        def version(text: str) -> tuple[int, ...]:
            return tuple(int(x) for x in text.split("."))

        def patch(module: Any, name: str, value: Any) -> None:
            undo.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, value)

        patch(fused, "check_cudnn_version", lambda: CUDNN)
        patch(fused, "check_compute_capability", lambda c: have >= version(c))
        patch(fused, "is_cuda_compute_capability_equal", lambda c: have == version(c))
        # Pallas' Triton lowering asks the default device for the GPU's kind where a mesh's
        # partitioner lowers a kernel outside the step's mesh (core.flash): the target's,
        # its cached answer forgotten before and after (another target may follow)
        try:
            from jax._src.pallas.triton import gpu_info
        except ImportError:  # a JAX that reads it elsewhere: its lowering says so
            gpu_info = None
        kinds = ("get_device_kind", "get_device_platform", "get_gpu_info")
        if all(hasattr(gpu_info, n) for n in kinds):
            clear = getattr(gpu_info.get_gpu_info, "cache_clear", lambda: None)
            undo.callback(clear)
            patch(gpu_info, "get_device_kind", lambda: device.device_kind)
            patch(gpu_info, "get_device_platform", lambda: "gpu")
            clear()
        yield


_NO_HOST = (
    "--target compiles for the {}, which is not here, and the GPU compiler of this JAX fails on "
    "offload's update=host without a GPU: explain the update on the devices (the default), "
    "or without --target (the CPU's figures)"
)


_NO_REMAT = (
    "--target compiles for the {}, which is not here, and this JAX drops --remat offload's "
    "moves to host memory for a device without memories: explain it with --remat full (the "
    "same recomputation, the inputs kept on the device) or without --target"
)


_PRODUCT = re.compile(r"\b(?:dot|convolution)\(|__cublas|__cudnn")
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.MULTILINE)
_COPY = re.compile(r"=\s*\((.*?)\) copy-start\(")


def host_copies(hlo_text: str) -> tuple[int, int, float]:
    """In a compiled GPU program's schedule: how many copies bring host memory (``S(5)``)
    to the device, how many of them start before the program's last matrix product
    (overlapping the backward pass; a loop or call that runs one counts as one), and how
    far through the schedule the first starts (0 to 1)."""
    from shardplug.core.compiled.hlo import computations, reached

    program = computations(hlo_text)
    found = _ENTRY.search(hlo_text)
    entry = program.get(found.group(1), []) if found else []

    @functools.cache
    def runs_product(callee: str) -> bool:  # the computation, or one it calls
        return any(_PRODUCT.search(i.text) for i in reached(program, callee))

    last = max((k for k, i in enumerate(entry) if _PRODUCT.search(i.text)
                or any(runs_product(c) for _, c in i.calls)), default=-1)  # fmt: skip
    starts = [k for k, i in enumerate(entry) if i.opcode == "copy-start" and _to_device(i.text)]
    first = starts[0] / max(len(entry), 1) if starts else 1.0
    return len(starts), sum(k < last for k in starts), first


def host_slices(hlo_text: str) -> tuple[int, int]:
    """In a compiled GPU program: how many asynchronous slice writes into arrays in host
    memory (``S(5)``) and slice reads out of them it runs, each loop's body counted once:
    how a remat policy's moves to the host compile (a layer stack's inputs, one layer at a
    time)."""
    from shardplug.core.compiled.hlo import computations
    from shardplug.core.compiled.program import elements

    written = read = 0
    for instructions in computations(hlo_text).values():
        for i in instructions:
            if i.opcode != "fusion-start" or "S(5)" not in i.text:
                continue
            result = i.text.split("=", 1)[1].split(" fusion-start(", 1)[0]
            parts = elements(result)  # ((operands), result, context)
            if len(parts) == 3 and "S(5)" in parts[1]:
                written += 1
            else:
                read += 1
    return written, read


def _to_device(line: str) -> bool:
    """Whether an HLO line starts a copy from host memory to the device's: XLA's
    ``copy-start`` gives (destination, source, context)."""
    found = _COPY.search(line)
    if found is None:
        return False
    parts = re.split(r",\s*(?![^{\[]*[}\]])", found.group(1))
    return len(parts) == 3 and "S(5)" not in parts[0] and "S(5)" in parts[1]
