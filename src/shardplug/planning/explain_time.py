"""``explain``'s predicted step: the time of the compiled step on the GPU it is compiled for,
its throughput and MFU, and its parts (:func:`shardplug.predict_step`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardplug.core.compiled.chips import Chip, chip_of
from shardplug.core.compiled.timing import predict_step
from shardplug.loop.feed import global_struct


def predicted(trainer: Any, batch: Any, chip: Chip | None = None) -> dict[str, Any] | None:
    """The predicted step of ``trainer``'s compiled program (None where its devices are no
    GPU shardplug knows, and no ``chip`` is given): ``{"seconds", "samples_per_second",
    "tokens_per_second", "model_flops", "mfu", "chip", "parts", "exposed_seconds",
    "largest", "unresolved"}``. Tokens are the rows times the sequence of the batch's first
    integer leaf of two dimensions or more (None without one); MFU is the model's FLOPs (the
    task's ``flops_per_sample``, else 3 x its forward's products) over the chip's dense bf16
    peak on every device."""
    device = trainer.mesh.devices.flat[0]
    chip = chip or chip_of(device)
    if chip is None or trainer.compiled is None:
        return None
    step = predict_step(trainer.compiled, chip)
    structs = [global_struct(x) for x in jax.tree.leaves(batch)]
    shapes = [(tuple(x.shape), np.dtype(x.dtype)) for x in structs]
    rows = shapes[0][0][0] if shapes and shapes[0][0] else 1
    integer = [s for s, d in shapes if len(s) >= 2 and np.issubdtype(d, np.integer)]
    tokens = integer[0][0] * integer[0][1] if integer else None
    flops = (
        trainer.flops_per_sample * rows
        if trainer.flops_per_sample
        else getattr(trainer.program, "model_flops", None)
    )
    devices = int(trainer.mesh.size)
    seconds = step.seconds
    out = step.to_dict()
    # a checkpoint's floor: the state each device holds, copied off it over PCIe
    leaves = jax.tree.leaves(trainer.state)
    held = sum(_shard_bytes(x, s) for x, s in
               zip(leaves, jax.tree.leaves(trainer.state_shardings), strict=True))  # fmt: skip
    out["checkpoint_bytes"] = held
    out["checkpoint_copy_seconds"] = held / chip.pcie
    out.update(
        samples_per_second=rows / seconds if seconds else None,
        tokens_per_second=tokens / seconds if tokens and seconds else None,
        model_flops=flops,
        mfu=flops / (seconds * devices * chip.peak("bf16")) if flops and seconds else None,
        devices=devices,
    )
    return out


def _shard_bytes(leaf: Any, sharding: Any) -> int:
    """The bytes one device holds of an abstract leaf laid out by ``sharding``."""
    shape = sharding.shard_shape(leaf.shape) if hasattr(sharding, "shard_shape") else leaf.shape
    try:
        return int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    except TypeError:  # a PRNG key's: a few bytes
        return 0


def lines(timing: dict[str, Any]) -> list[str]:
    """The predicted step as a few lines for ``explain``'s text."""
    from shardplug.core.compiled.timing import StepTime

    step = StepTime(timing["seconds"], timing["chip"], timing["parts"])
    head = f"predicted step on {timing['devices']} x {timing['chip'].upper()}: "
    head += f"{timing['seconds'] * 1e3:,.1f} ms"
    if timing.get("tokens_per_second"):
        head += f", {timing['tokens_per_second']:,.0f} tokens/s"
    elif timing.get("samples_per_second"):
        head += f", {timing['samples_per_second']:,.1f} samples/s"
    if timing.get("mfu") is not None:
        head += f", MFU {timing['mfu']:.1%}"
    exposed = timing["exposed_seconds"]
    head += f" ({timing['compute_seconds'] * 1e3:,.1f} ms of kernels"
    head += f", {exposed * 1e3:,.1f} ms of communication and copies exposed)"
    out = [head, *(f"  {line}" for line in step.lines())]
    copy = timing.get("checkpoint_copy_seconds")
    if copy and timing["seconds"]:
        share = copy / timing["seconds"]
        out.append(
            f"  a checkpoint copies {timing['checkpoint_bytes'] / 1e9:,.2f} GB off each device: "
            f"{copy * 1e3:,.1f} ms over PCIe, {share:.0%} of a step; saved every 10 steps, "
            f"{share / 10:.1%} (--local-checkpoint-every into a RAM disk blocks for this copy "
            f"alone, twice across hosts with a peer's; a failure loses 5 steps on average)"
        )
    if timing.get("unresolved"):
        out.append(f"  {timing['unresolved']} conditionals' branches not told by the program: "
                   "the longest taken")  # fmt: skip
    return out
