"""The optimizer a run names: AdamW, Adam or SGD, a learning-rate schedule (linear warmup, then
constant, cosine, linear or warmup-stable-decay) and clipping by global norm, as one typed,
frozen value (:class:`Optimizer`) that optax builds (:meth:`Optimizer.build`).

The command line's ``--optimizer``, ``--lr``, ``--weight-decay``, ``--momentum``,
``--schedule``, ``--warmup``, ``--decay-steps``, ``--end-lr`` and ``--clip-norm`` make one
(:func:`shardplug.cli.tasks.task_of`); the run says it in its first lines
(:meth:`Optimizer.describe`) and a checkpoint records it (:meth:`Optimizer.recorded`), so a
resumed run continues the same schedule from the step it saved.

Given no knob, it is what the run had before there were knobs: ``optax.adam(lr)`` for a
reference model, ``optax.adamw(lr)`` (optax's weight decay, 1e-4) for a pretrained checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardplug.errors import ConfigError

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
#: the weight decay ``adamw`` applies when given none (optax's)
ADAMW_DECAY = 1e-4
#: the fraction of a ``wsd`` schedule's steps that decays (after its stable part)
WSD_DECAY = 0.2


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optimizer by name, its learning rate, schedule and clipping.

    :param name: ``adam``, ``adamw`` (Adam with decoupled weight decay) or ``sgd``.
    :param lr: the peak learning rate (reached after ``warmup`` steps).
    :param weight_decay: ``adamw``'s decoupled weight decay, applied to every parameter
        (default 1e-4, optax's); refused for ``adam`` and ``sgd``.
    :param momentum: ``sgd``'s (default none: plain SGD); refused for the others.
    :param schedule: after the warmup, the rate stays (``constant``), falls along a cosine
        (``cosine``) or a line (``linear``) to ``end_lr`` at step ``decay_steps``, or stays
        and falls along a line over the last 20% of ``decay_steps`` (``wsd``,
        warmup-stable-decay).
    :param warmup: steps of linear warmup from 0 to ``lr``.
    :param decay_steps: the step at which a decaying schedule reaches ``end_lr`` (the run's
        ``--steps`` on the command line); needed by every schedule but ``constant``.
    :param end_lr: where a decaying schedule ends (default 0).
    :param clip_norm: clip the gradient to this global norm before the update.
    :raises ConfigError: in one line, for a name, value or combination that is not one.
    """

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float | None = None
    momentum: float | None = None
    schedule: str = "constant"
    warmup: int = 0
    decay_steps: int | None = None
    end_lr: float = 0.0
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        for field in ("lr", "weight_decay", "momentum", "end_lr", "clip_norm"):
            value = getattr(self, field)
            if (value is None and field != "lr") or (
                isinstance(value, int | float) and not isinstance(value, bool)):  # fmt: skip
                continue
            raise ConfigError(f"{_flag(field)} must be a number, got {value!r}")
        for field in ("warmup", "decay_steps"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{_flag(field)} must be a whole number of steps, got {value!r}")
        for field, value in (("lr", self.lr), ("clip_norm", self.clip_norm)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{_flag(field)} must be a positive number, got {value}")
        for field, value in (("weight_decay", self.weight_decay), ("end_lr", self.end_lr),
                             ("momentum", self.momentum)):  # fmt: skip
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{_flag(field)} must be 0 or more, got {value}")
        if self.weight_decay is not None and self.name != "adamw":
            raise ConfigError(
                f"--weight-decay is adamw's (decoupled weight decay); {self.name} has none: "
                f"give --optimizer adamw, or drop --weight-decay"
            )
        if self.momentum is not None and self.name != "sgd":
            raise ConfigError(f"--momentum is sgd's; {self.name} keeps its own moments: drop it")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more steps, got {self.warmup}")
        if self.schedule == "constant":
            if self.end_lr:
                raise ConfigError("--end-lr is where a decaying --schedule ends; constant has none")
            if self.decay_steps is not None:
                raise ConfigError("--decay-steps is where a decaying --schedule ends; constant "
                                  "has none: give --schedule cosine, linear or wsd")  # fmt: skip
            return
        if self.decay_steps is None or self.decay_steps <= self.warmup:
            raise ConfigError(
                f"a {self.schedule} schedule decays from the end of its warmup ({self.warmup} "
                f"steps) to step {self.decay_steps}: give more --steps (or --decay-steps) "
                f"than --warmup"
            )
        if self.end_lr > self.lr:
            raise ConfigError(f"--end-lr {self.end_lr} is above --lr {self.lr}: a decay falls")
        falling = max(1, round(WSD_DECAY * self.decay_steps))
        if self.schedule == "wsd" and self.warmup > self.decay_steps - falling:
            raise ConfigError(
                f"a wsd schedule falls over its last {falling} steps (20% of "
                f"{self.decay_steps}), from step {self.decay_steps - falling}; a --warmup of "
                f"{self.warmup} runs into that: give a shorter warmup or more steps"
            )

    def learning_rate(self) -> Any:
        """The learning rate: the number itself where it is constant with no warmup, else an
        optax schedule of the step."""
        import optax

        lr, warm = self.lr, self.warmup
        if self.schedule == "constant":
            if not warm:
                return lr
            return optax.join_schedules(
                [optax.linear_schedule(0.0, lr, warm), optax.constant_schedule(lr)], [warm]
            )
        if self.schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(0.0, lr, warm, self.decay_steps,
                                                      self.end_lr)  # fmt: skip
        if self.schedule == "linear":
            after = optax.linear_schedule(lr, self.end_lr, self.decay_steps - warm)
        else:  # wsd: stable, then the last WSD_DECAY of the steps falling along a line
            falling = max(1, round(WSD_DECAY * self.decay_steps))
            stable = max(0, self.decay_steps - falling - warm)
            after = optax.join_schedules(
                [optax.constant_schedule(lr), optax.linear_schedule(lr, self.end_lr, falling)],
                [stable],
            )  # fmt: skip
        if not warm:
            return after
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])

    def build(self) -> Any:
        """The ``optax.GradientTransformation``: the clipping (if any), then the optimizer."""
        import optax

        rate = self.learning_rate()
        if self.name == "adam":
            made = optax.adam(rate)
        elif self.name == "adamw":
            decay = ADAMW_DECAY if self.weight_decay is None else self.weight_decay
            made = optax.adamw(rate, weight_decay=decay)
        else:
            made = optax.sgd(rate, momentum=self.momentum)
        if self.clip_norm is None:
            return made
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), made)

    def describe(self) -> str:
        """One line, as a run says it: ``adamw, lr 1e-4 (warmup 100 steps, then cosine to 0 at
        step 1000), weight decay 0.01, gradient clipped at global norm 1``."""
        parts = [self.name]
        shape = [f"warmup {self.warmup} steps"] if self.warmup else []
        if self.schedule == "wsd":
            falling = max(1, round(WSD_DECAY * self.decay_steps))
            shape.append(f"stable, then linear to {self.end_lr:g} over steps "
                         f"{self.decay_steps - falling} to {self.decay_steps}")  # fmt: skip
        elif self.schedule != "constant":
            shape.append(f"{self.schedule} to {self.end_lr:g} at step {self.decay_steps}")
        parts[0] += f", lr {self.lr:g}" + (f" ({', then '.join(shape)})" if shape else "")
        if self.name == "adamw":
            decay = ADAMW_DECAY if self.weight_decay is None else self.weight_decay
            parts.append(f"weight decay {decay:g}")
        if self.momentum:
            parts.append(f"momentum {self.momentum:g}")
        if self.clip_norm is not None:
            parts.append(f"gradient clipped at global norm {self.clip_norm:g}")
        return ", ".join(parts)

    def recorded(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (``Optimizer(**recorded)`` is it again)."""
        return dataclasses.asdict(self)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


__all__ = ["OPTIMIZERS", "SCHEDULES", "Optimizer"]
