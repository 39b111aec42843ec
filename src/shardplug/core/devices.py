"""Which devices a run uses, and simulated CPU devices for machines without an accelerator."""

from __future__ import annotations

import contextlib
from typing import Any

import jax

from shardplug.errors import DeviceError


def simulate_cpu_devices(count: int) -> None:
    """Ask JAX for ``count`` CPU devices, so every strategy runs on a machine without a GPU.

    Must run before JAX creates its backends (before the first array is made). After that it
    does nothing, and :func:`select_devices` reports if too few devices exist. It only affects
    the CPU backend: on a GPU machine the GPUs are still the default devices.
    """
    # Once backends exist this raises; select_devices then checks what we got.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count)


def select_devices(count: int | None = None) -> list[Any]:
    """The first ``count`` devices of the default backend (all of them for None)."""
    devices = jax.devices()
    if count is None:
        return list(devices)
    if count < 1:
        raise DeviceError(f"the device count must be at least 1, got {count}")
    if count > len(devices):
        raise DeviceError(
            f"asked for {count} devices but only {len(devices)} "
            f"{devices[0].platform.upper()} devices exist: ask for fewer"
        )
    return list(devices[:count])
