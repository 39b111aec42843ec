"""Which devices a run uses, and simulated CPU devices for machines without an accelerator.

The decision is written once: a run uses every device of JAX's default backend. When that
backend is an accelerator (GPU, TPU) that is all of them; when there is none, the command
line first asks JAX for :data:`SIMULATED` CPU devices, so every strategy runs on a laptop.
``--devices N`` (``Trainer(devices=N)``) picks the first N instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Sequence
from typing import Any

import jax

from shardplug.errors import DeviceError, warn_once

#: CPU devices the command line simulates when no --devices is given and there is no GPU
SIMULATED = 8
#: the most CPU devices shardplug simulates: each is a thread pool; 8,192 took 13 s to make
#: on a 2-core machine, and at 32,768 JAX's runtime aborted after 85 s, out of threads
MAX_SIMULATED = 4096

CUDA_INSTALL = "pip install -U 'jax[cuda12]' (in a checkout of shardplug: pip install -e '.[cuda]')"


def simulate_cpu_devices(count: int | None = None) -> None:
    """Ask JAX for ``count`` CPU devices (default :data:`SIMULATED`), so every strategy runs
    on a machine without a GPU.

    Must run before JAX creates its backends (before the first array is made). After that it
    does nothing, and :func:`select_devices` reports if too few devices exist. It only affects
    the CPU backend: on a GPU machine the GPUs are still the default devices.
    """
    if count is not None and count > MAX_SIMULATED:
        raise DeviceError(
            f"{count} devices: shardplug simulates at most {MAX_SIMULATED} CPU devices (each "
            "is a thread pool; tens of thousands take minutes, then JAX runs out of threads); "
            "ask for fewer"
        )
    # Once backends exist this raises; select_devices then checks what we got.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count or SIMULATED)


def select_devices(count: int | None = None, *, devices: Sequence[Any] | None = None) -> list[Any]:
    """The first ``count`` of ``devices`` (default: the default backend's), all for None.

    :raises DeviceError: for a count below 1, or above the devices that exist (naming them).
    """
    devices = list(jax.devices() if devices is None else devices)
    platform = devices[0].platform
    if platform == "cpu" and nvidia_gpu_visible():
        warn_once(cpu_only_note(), stacklevel=2)
    if count is None:
        return devices
    if count < 1:
        raise DeviceError(f"the device count must be at least 1, got {count}")
    if count > len(devices):
        kind = getattr(devices[0], "device_kind", platform)
        what = f"{len(devices)} {platform.upper()} device{'s' * (len(devices) > 1)} ({kind})"
        raise DeviceError(
            f"asked for {count} devices but this machine has {what}: ask for at most "
            f"{len(devices)}, or leave --devices out to use them all"
        )
    return devices[:count]


def nvidia_gpus() -> int:
    """How many NVIDIA GPUs the system shows (their device files), whatever JAX sees; the
    ``CUDA_VISIBLE_DEVICES`` this process was given, if any, counts instead."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip() and g.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def nvidia_gpu_visible() -> bool:
    """Whether the system shows an NVIDIA GPU, whatever JAX sees."""
    return nvidia_gpus() > 0


def cpu_only_note() -> str:
    """What to say when the system has a GPU but JAX has only its CPU backend."""
    return (
        "an NVIDIA GPU is visible to the system but JAX has only its CPU backend, so this "
        f"run uses the CPU: install JAX's CUDA plugin with {CUDA_INSTALL}"
    )


def is_compile_only(device: Any) -> bool:
    """Whether ``device`` is a GPU compiled for and not present (``explain --target``'s,
    :func:`shardplug.core.compiled.targets.target_devices`)."""
    return device.platform == "gpu" and device not in jax.devices()
