"""What a plugin may declare besides its hooks, as class attributes; core reads no other
attribute of a plugin, and reads these only through :func:`declared`.

- ``description: str``: one line for ``shardplug strategies`` (default: the docstring's first);
- ``unsupported: dict[str, str]``: capabilities it lacks (a :class:`Capability`, its value
  as a str, or one of its own ``capabilities``), with the reason the conformance suite shows
  when it skips their checks;
- ``capabilities: dict[str, str]``: capabilities beyond the built-in ones, each with what a
  model (or run) of that kind has, for the checks of its own suite
  (``StrategyConformance.requires``) and its ``unsupported``;
- ``baseline: str``: for a whole strategy, how its step is written by hand, for bench:
  ``"jit"`` (``jax.jit`` with its shardings) or ``"shard_map"``.

Example::

    class PerDeviceProgram:  # data parallel as an explicit per-device program
        baseline = "shard_map"
        unsupported = {"uneven-shapes": "every device holds whole parameters"}
"""

from __future__ import annotations

import enum
from typing import Any


class Capability(enum.StrEnum):
    """What a plugin may declare it cannot do (its ``unsupported`` keys); each is one group
    of the conformance suite's checks, skipped with the plugin's reason. Every use of a
    capability in core and the suite goes through this declaration."""

    #: the adapters: the model's framework
    NNX = "nnx"
    LINEN = "linen"
    EQUINOX = "equinox"
    #: models with state besides parameters (batch statistics: the ``cnn``)
    MODEL_STATE = "model-state"
    #: parameters whose dimensions no mesh axis divides
    UNEVEN_SHAPES = "uneven-shapes"
    #: the batch is split over devices, not replicated (a composition with a batch axis has it)
    BATCH_SPLIT = "batch-split"
    #: models without a layer stack (``shardplug.stack``)
    WITHOUT_LAYER_STACK = "without-layer-stack"
    #: models whose batch has no sequence dimension (a parallelism that splits the sequence;
    #: its checks then run on the transformer)
    WITHOUT_SEQUENCE = "without-sequence"
    #: models without a mixture of experts (a parallelism that splits the experts; its
    #: checks then run on the transformer's)
    WITHOUT_EXPERTS = "without-experts"
    #: meshes whose axes are ``AxisType.Explicit`` (``axis_types="explicit"``); a plugin that
    #: declares it unsupported is refused in that mode, with its reason
    EXPLICIT_AXES = "explicit-axes"


CAPABILITIES = tuple(c.value for c in Capability)
BASELINES = ("jit", "shard_map")


def declared(plugin: Any, field: str) -> Any:
    """A plugin's declared ``field`` (``description``, ``unsupported``, ``capabilities`` or
    ``baseline``),
    checked: a mistyped one is a :class:`shardplug.errors.PluginError` naming it."""
    from shardplug.errors import PluginError

    value = getattr(plugin, field, None)
    name = getattr(plugin, "__name__", type(plugin).__name__)
    if field == "capabilities":
        value = dict(value or {})
        wrong = [
            k for k, v in value.items()
            if not isinstance(k, str) or k in CAPABILITIES or not isinstance(v, str)
        ]  # fmt: skip
        if wrong:
            raise PluginError(
                f"plugin {name}: capabilities names {wrong[0]!r}: a capability of its own is "
                f"a new name (not one of {', '.join(CAPABILITIES)}) with what it means (a str)"
            )
    elif field == "unsupported":
        value = dict(value or {})
        known = (*CAPABILITIES, *declared(plugin, "capabilities"))
        wrong = [k for k, v in value.items() if k not in known or not isinstance(v, str)]
        if wrong:
            raise PluginError(
                f"plugin {name}: unsupported names {wrong[0]!r}, which is not a capability "
                f"({', '.join(known)}) with a reason (a str)"
            )
    elif field == "baseline" and value not in (None, *BASELINES):
        raise PluginError(f"plugin {name}: baseline must be one of {BASELINES}, got {value!r}")
    elif field == "description" and value is not None and not isinstance(value, str):
        raise PluginError(f"plugin {name}: description must be a str, got {value!r}")
    elif field not in ("unsupported", "baseline", "description"):
        raise ValueError(f"no declared field {field!r}")
    return value
