"""The exceptions shardplug raises for input it cannot use.

Every one of them derives from :class:`ShardplugError`, and its message is one line that says
what was wrong and what to do instead. The command line prints that line and exits non-zero;
Python callers can catch the base class or a specific one.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent) + "/"
#: lines JAX adds to an exception's message that say nothing of its cause
_NOISE = ("For simplicity, JAX has removed its internal frames", "-" * 20)


class ShardplugError(Exception):
    """Base class of every error shardplug raises for input it cannot use."""


class UnknownStrategyError(ShardplugError, LookupError):
    """No installed strategy has the requested name."""

    def __init__(self, name: str, available: Iterable[str], kind: str = "strategy"):
        self.name = name
        self.available = sorted(available)
        super().__init__(
            f"unknown {kind} {name!r}; available: {', '.join(self.available) or '(none)'}"
        )


class UnknownModelError(ShardplugError, LookupError):
    """No reference model or adapter has the requested name."""


class StrategyOptionError(ShardplugError, TypeError):
    """A strategy was given an option it does not accept, or a value it cannot use."""


class CompositionError(ShardplugError, ValueError):
    """Parallelisms that cannot be composed: a whole strategy in a composition, two
    parallelisms on one mesh axis or one parameter dimension (both named)."""


class MeshError(ShardplugError, ValueError):
    """A mesh description is malformed or does not match the devices."""


class DeviceError(ShardplugError, RuntimeError):
    """Fewer devices are available than were asked for."""


class BatchError(ShardplugError, ValueError):
    """A batch cannot be split the way the strategy asks."""


class ConfigError(ShardplugError, ValueError):
    """A training argument is out of range or of the wrong kind."""


class TaskError(ConfigError):
    """A task (``--task FILE.py:NAME``) that cannot be loaded: no such file or module, no
    such name, or not a :class:`shardplug.Task`."""


class TraceAgain(ShardplugError):
    """Raised by a parallelism's ``check_program`` that has changed what it will trace (pp's
    ``auto`` schedule falling back to GPipe): core traces and compiles the step once more."""


class PluginError(ShardplugError):
    """A strategy plugin failed to load, or a hook of it failed or returned something unusable."""


class RuleError(ShardplugError, ValueError):
    """A sharding rule matches no parameter, or two rules match one parameter."""


class CheckpointError(ShardplugError):
    """No usable checkpoint: none there, all damaged, or one of another model (named)."""


class PretrainedError(ShardplugError, ValueError):
    """A pretrained checkpoint that cannot be loaded as asked: no config, an architecture
    shardplug does not know, a tensor of the wrong shape, a missing shard, a tokenizer of
    another vocabulary, a dtype it cannot be cast to."""


class NonFiniteError(ShardplugError, FloatingPointError):
    """The loss or a gradient became NaN or infinite; names the step and the last good
    checkpoint. ``step`` and ``checkpoint`` hold them."""

    def __init__(self, message: str, *, step: int, checkpoint: str | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint

    @classmethod
    def at(cls, step: int, checkpoint: str | None, what: str = "the loss is") -> NonFiniteError:
        """The error for ``step``, naming the last good checkpoint and what to do."""
        last = f"last good checkpoint: {checkpoint}" if checkpoint else "no checkpoint saved"
        return cls(
            f"{what} not finite (NaN or inf) at step {step}; {last}. Lower the learning rate, "
            "or skip such steps with on_nonfinite='skip' (--on-nonfinite skip)",
            step=step,
            checkpoint=checkpoint,
        )


class TrainingInterrupted(ShardplugError):
    """SIGINT or SIGTERM stopped training after a step, which was saved; ``signal``,
    ``step`` and ``checkpoint`` say which, where and where to."""

    def __init__(self, message: str, *, signal: int, step: int, checkpoint: str | None):
        super().__init__(message)
        self.signal, self.step, self.checkpoint = signal, step, checkpoint


class ShardplugWarning(UserWarning):
    """Something shardplug worked around, e.g. an installed plugin that failed to load."""


_SAID: set[str] = set()


def unsay(messages: Iterable[str]) -> None:
    """Forget that :func:`warn_once` said ``messages``, whose warnings were dropped (with a
    refused program): a later program that warns the same says it."""
    _SAID.difference_update(messages)


def warn_once(message: str, stacklevel: int | None = None) -> None:
    """A :class:`ShardplugWarning` said once per process, however often its cause recurs,
    attributed ``stacklevel`` frames up from the caller. By default: called from
    shardplug's own code, 2 (the call that led to it); from a plugin's (or any other) code,
    1, the plugin's own line."""
    if message not in _SAID:
        _SAID.add(message)
        if stacklevel is None:
            caller = str(Path(sys._getframe(1).f_code.co_filename).resolve())
            stacklevel = 2 if caller.startswith(_HERE) else 1
        warnings.warn(message, ShardplugWarning, stacklevel=stacklevel + 1)


def one_line(exc: BaseException, limit: int = 800) -> str:
    """``exc``'s message as one line, its cause kept: every line of it joined (a sentence
    closed where a line did not end in punctuation), JAX's note about its removed frames
    dropped; at most ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines()]
    text = ""
    for line in (line for line in lines if line and not line.startswith(_NOISE)):
        if text and text[-1] not in ".:;,!?(":
            text += "."
        text += (" " if text else "") + line
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
