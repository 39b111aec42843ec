"""The trainer's settings, validated once, in one place."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from shardplug.core.precision import Precision, compute_dtype
from shardplug.errors import ConfigError

OnNonFinite = Literal["stop", "skip"]
AxisTypes = Literal["auto", "explicit"]


def _positive(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a :class:`~shardplug.Trainer` runs: its keyword arguments of the same names.

    :param seed: seeds the parameter initialisation of a model the adapter builds.
    :param log_every: the loop waits for the devices only every ``log_every`` steps (and at
        the end), to read the metrics; ``step_time`` is the mean over that window.
    :param checkpoint_dir: where to keep checkpoints (created if missing; must be writable).
        :meth:`fit` then saves every ``checkpoint_every`` steps and when it ends, in the
        background, each device writing its own shards; SIGINT and SIGTERM finish the
        current step, save it and raise :class:`shardplug.errors.TrainingInterrupted`.
        Continue a run with :meth:`restore`.
    :param checkpoint_every: steps between checkpoints (None: only when ``fit`` ends).
    :param local_checkpoint_dir: a second, frequent tier of checkpoints, in a folder of
        fast local storage (a RAM disk: ``/dev/shm/...``), saved every
        ``local_checkpoint_every`` steps and keeping the newest two: each process writes its
        own shards and a copy of the previous process's, so that a host lost with its
        storage loses nothing; a save blocks for the copy off the devices alone. ``restore``
        takes the newest complete checkpoint of either tier, onto any device count.
    :param keep: how many checkpoints to keep.
    :param config: JSON-serialisable settings to store in each checkpoint (the command line
        stores its arguments), read back as ``trainer.restored_meta["config"]``.
    :param on_nonfinite: ``"stop"``: a NaN or infinite loss raises
        :class:`shardplug.errors.NonFiniteError` naming the step and the last good
        checkpoint (nothing more is saved; parameters that are not finite are never saved);
        ``"skip"``: a step whose loss or gradient norm is not finite leaves the model and
        optimizer as they were, and is counted in ``trainer.skipped_steps``.
    :param grad_accum: microbatches per step: the step computes the gradient of the batch
        in ``grad_accum`` parts, one after another, inside the compiled step, and makes one
        update, equal to that of the whole batch (batch statistics, being per microbatch,
        excepted). Activation memory falls to that of one microbatch.
    :param precision: ``"auto"`` (the Trainer's choice for its devices: see
        :class:`~shardplug.Trainer`), ``"float32"``, or ``"bfloat16"`` (``"bf16"``): the
        matrix products of forward and backward in bfloat16, on bfloat16 copies of the
        parameters and the batch's float32 leaves, stock layers that chose no dtype computing
        in it; parameters, gradients and optimizer state stay float32. Products left in
        float32 are warned of.
    :param profile_dir: write a profiler trace (TensorBoard, Perfetto) of the steps
        ``profile_steps`` (a ``range`` of step numbers, default 3 to 5, after compilation)
        into this directory (``process_<i>/`` in it for each process of a multi-process run).
    :param axis_types: the mesh's axis types: ``"auto"`` (JAX's ``AxisType.Auto``: the
        compiler propagates shardings), ``"explicit"`` (``AxisType.Explicit``: shardings are
        part of every array's type, for models that use ``jax.sharding.reshard``, einsums with
        ``out_sharding`` and the like), or None: explicit when the model's parameters already
        live on an explicit mesh or its code needs explicit axes (found when the step is
        first traced), auto otherwise; ``trainer.axis_types`` and ``axis_types_reason`` say
        which ran and why.
    :param data_timeout: seconds to wait for a batch before giving up (None: announced
        after 30 s, never given up).
    :param flops_per_sample: the model's textbook FLOPs per sample, for the rows'
        ``model_tflops`` and ``mfu``; ``peak_tflops``: a device's peak TFLOP/s, for devices
        shardplug does not know.
    """

    seed: int = 0
    log_every: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    local_checkpoint_dir: str | None = None
    local_checkpoint_every: int | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    on_nonfinite: OnNonFinite = "stop"
    grad_accum: int = 1
    precision: Precision | Literal["auto"] = "auto"
    profile_dir: str | None = None
    profile_steps: range = range(3, 6)
    axis_types: AxisTypes | None = None
    data_timeout: float | None = None
    flops_per_sample: float | None = None
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.config is None:  # as the Trainer always took it: nothing to store
            object.__setattr__(self, "config", {})
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        _positive("log_every", self.log_every)
        _positive("checkpoint_every", self.checkpoint_every, optional=True)
        _positive("keep", self.keep)
        _positive("grad_accum", self.grad_accum)
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs a checkpoint_dir to save into")
        _positive("local_checkpoint_every", self.local_checkpoint_every, optional=True)
        if (self.local_checkpoint_dir is None) != (self.local_checkpoint_every is None):
            raise ConfigError(
                "local_checkpoint_dir and local_checkpoint_every go together: the folder of "
                "the frequent tier, and its steps between saves"
            )
        if self.local_checkpoint_dir is not None and self.checkpoint_dir is None:
            raise ConfigError(
                "local_checkpoint_dir is a frequent tier beside checkpoint_dir's persistent "
                "one: give checkpoint_dir too"
            )
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.precision != "auto":  # the Trainer chooses for its devices
            compute_dtype(self.precision)
        if self.axis_types not in (None, "auto", "explicit"):
            raise ConfigError(
                f"axis_types must be 'auto', 'explicit' or None (chosen for the model), "
                f"got {self.axis_types!r}"
            )
        steps = self.profile_steps
        if not isinstance(steps, range) or not steps or steps.step != 1:
            raise ConfigError(f"profile_steps must be a non-empty range of steps, got {steps!r}")
        try:
            json.dumps(dict(self.config))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config must be JSON-serialisable: {exc}") from None
        for name in ("checkpoint_dir", "profile_dir", "local_checkpoint_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))
        object.__setattr__(self, "config", dict(self.config))


    @classmethod
    def of(cls, settings: Settings | None, keywords: Mapping[str, Any]) -> Settings:
        """``settings`` (the defaults where None) with ``keywords``, its fields by name, in
        their place: a :class:`~shardplug.Trainer`'s keyword arguments. A name that is no
        setting is refused in one line that lists them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise ConfigError(
                f"Trainer takes no keyword {unknown[0]!r}: its settings are "
                f"{', '.join(sorted(names))} (shardplug.settings.Settings), besides adapter, "
                f"loss_fn, optimizer, strategy, devices, mesh, axis_names, allocate"
            )
        return dataclasses.replace(settings or cls(), **keywords)


def reads(owner: str, name: str, doc: str = "") -> property:
    """A property that reads ``name`` of the value held in attribute ``owner`` (None while
    that is None)."""
    return property(lambda self: getattr(getattr(self, owner), name, None), doc=doc)
