"""The per-layer gather: a layer stack's parameters gathered one layer at a time.

A parallelism that stores a stacked parameter split and gathers it at use (ZeRO-3) names,
through ``gather_param``, the layout one layer has where the step uses it (core hands it
to :func:`layer_specs`, by the parameter's id).
The layer stack's scan then constrains each layer's slice to that layout inside the loop
(:func:`layer_gather`), and :func:`regathered` keeps the gathered layer out of the backward
pass's residuals, gathering it again there: ZeRO-3, one layer whole at a time.

A stacked weight the step makes from parts before the model runs (LoRA's ``W + s L @ R``,
a quantized base dequantized) may say how one layer's is made from one layer's parts
(:func:`made_by_layer`): a stack then scans over the parts and makes each layer's weight
inside its loop (:func:`made_of`), one layer's at a time; the whole weight, made for a model
that reads it elsewhere, is left unused and the compiler drops it.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardplug.core.operations.remat import named_input, saveable
from shardplug.core.sharding import lay_out

#: the name of a stacked parameter's layer where the step uses it (gathered at use)
GATHERED = "shardplug_gathered_layer"

#: id(stacked parameter) -> its layout where one layer is used (set by gather_params)
_LAYER_SPECS: contextvars.ContextVar[dict[int, P] | None] = contextvars.ContextVar(
    "shardplug_layer_specs", default=None
)


#: id(a stacked weight made whole) -> (a reference to it, its parts, how a layer's is made)
_MADE: contextvars.ContextVar[dict[int, tuple[Any, Any, Callable[[Any], Any]]] | None] = (
    contextvars.ContextVar("shardplug_made_by_layer", default=None)
)


#: the weights made by layer that a layer stack took (by id), in the outermost layer_specs
_TAKEN: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("shardplug_taken",
                                                                        default=None)


@contextlib.contextmanager
def layer_specs(specs: dict[int, P]) -> Iterator[None]:
    """Inside, the stacked parameters named by id are gathered one layer at a time (and
    weights made by layer, :func:`made_by_layer`, are made inside the stack's loop)."""
    token = _LAYER_SPECS.set({**(_LAYER_SPECS.get() or {}), **specs})
    made = _MADE.set({**(_MADE.get() or {})})
    taken = _TAKEN.set(_TAKEN.get() if _TAKEN.get() is not None else set())  # one per step
    try:
        yield
    finally:
        _TAKEN.reset(taken)
        _MADE.reset(made)
        _LAYER_SPECS.reset(token)


def made_by_layer(whole: Any, parts: Any, make: Callable[[Any], Any]) -> None:
    """``whole``, a stacked weight, is ``make`` applied to ``parts`` (arrays stacked alike)
    layer by layer: inside the current :func:`layer_specs`, a layer stack given ``whole``
    runs on ``parts`` and calls ``make`` on each layer's slice of them in its loop."""
    made = _MADE.get()
    if made is not None:
        made[id(whole)] = (weakref.ref(whole), parts, make)


def made_of(leaf: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """The parts of ``leaf`` and how a layer of it is made of theirs, where
    :func:`made_by_layer` said; else None."""
    entry = (_MADE.get() or {}).get(id(leaf))
    if entry is None or entry[0]() is not leaf:  # an id reused by another array
        return None
    taken = _TAKEN.get()
    if taken is not None:
        taken.add(id(leaf))
    return entry[1], entry[2]


def made_in_a_loop(whole: Any) -> bool:
    """Whether a layer stack took ``whole`` (:func:`made_by_layer`'s) to make by layer."""
    return id(whole) in (_TAKEN.get() or ())


def follow(old: Any, new: Any) -> None:
    """``new`` stands where ``old`` stood (a weight made from a stacked parameter, as LoRA's
    merge makes one): inside the current :func:`layer_specs`, gather it a layer at a time as
    ``old`` would have been."""
    specs = _LAYER_SPECS.get()
    if specs is not None and id(old) in specs:
        specs[id(new)] = specs[id(old)]  # this context's own dict: a layer_specs copy


def layer_gather(params: Any) -> Callable[[Any], Any] | None:
    """A function constraining one layer's slice of ``params`` where the step uses it; None
    where no parameter of the stack is gathered by layer."""
    specs = _LAYER_SPECS.get() or {}
    leaves, treedef = jax.tree.flatten(params)
    used = [specs.get(id(leaf)) for leaf in leaves]
    if not any(s is not None for s in used):
        return None

    def gather(layer):
        out = [
            leaf if spec is None else checkpoint_name(lay_out(leaf, P(*spec[1:])), GATHERED)
            for leaf, spec in zip(jax.tree.leaves(layer), used, strict=True)
        ]
        return jax.tree.unflatten(treedef, out)

    return gather


def regathered(body: Callable, policy: str) -> Callable:
    """``body`` (which gathers its layer) whose gathered layer is not kept for the backward
    pass but gathered again there (ZeRO-3: one layer whole at a time, forward and backward);
    other residuals are kept as the block's remat policy says."""
    keeps = saveable(policy) or jax.checkpoint_policies.everything_saveable

    def keep(prim: Any, *avals: Any, **params: Any) -> bool:
        if prim.name == "sharding_constraint":
            return False
        if prim.name == "name" and params.get("name") == GATHERED:
            return False
        return keeps(prim, *avals, **params)  # a bool, or where ``offload`` moves it

    return jax.checkpoint(named_input(body, policy), policy=keep)
