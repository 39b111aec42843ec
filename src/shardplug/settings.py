"""The trainer's settings, validated once, in one place."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from shardplug.core.step import Precision, _compute_dtype
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
    """How a :class:`~shardplug.Trainer` runs; see its parameters of the same names."""

    seed: int = 0
    log_every: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    on_nonfinite: OnNonFinite = "stop"
    grad_accum: int = 1
    precision: Precision = "float32"
    profile_dir: str | None = None
    profile_steps: range = range(3, 6)
    axis_types: AxisTypes | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        _positive("log_every", self.log_every)
        _positive("checkpoint_every", self.checkpoint_every, optional=True)
        _positive("keep", self.keep)
        _positive("grad_accum", self.grad_accum)
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs a checkpoint_dir to save into")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        _compute_dtype(self.precision)
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
        for name in ("checkpoint_dir", "profile_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))
        object.__setattr__(self, "config", dict(self.config))
