"""A layer stack applied by a scan: what :mod:`shardplug.stack` calls under every strategy.

:func:`run_stack` is a ``lax.scan`` over the stack's leading (layer) dimension, each block
rematerialised by the policy asked for (:mod:`shardplug.core.operations.remat`), its layers gathered
one at a time where a parallelism stores them split (:mod:`shardplug.core.operations.layer_gather`);
or, where a parallelism of the run supplies the layer stack operation
(:mod:`shardplug.core.ops`), that parallelism's loop, given the same block.

On explicit mesh axes a scan refuses a stack split along its layers (a whole strategy
written for auto axes may split every leading dimension): the split moves to another
dimension the axes divide (one all-to-all) and each layer is gathered inside the loop, as
the compiler does on auto axes (:func:`off_the_layers`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core import ops
from shardplug.core.mesh import is_explicit
from shardplug.core.operations.beside import rewritten
from shardplug.core.operations.layer_gather import (
    follow,
    layer_gather,
    layer_specs,
    made_of,
    regathered,
)
from shardplug.core.operations.remat import remat
from shardplug.errors import ConfigError, warn_once

#: the logical name of a layer stack's leading dimension
LAYERS = "layers"


def layers_of(params: Any) -> int:
    sizes = {leaf.shape[0] for leaf in jax.tree.leaves(params)}
    if len(sizes) != 1:
        raise ConfigError(
            f"a layer stack's parameters must share their leading (layer) dimension, got "
            f"sizes {sorted(sizes)}"
        )
    return sizes.pop()


def run_stack(fn: Callable[..., Any], params: Any, x: jax.Array, policy: str = "none",
              per_layer: Any = None, rows: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    """Apply ``fn(layer_params, x)`` for each layer of ``params`` in turn (see the module);
    with ``per_layer`` (a pytree of arrays with the same leading dimension, not trained: a
    router's balancing bias) ``fn(layer_params, x, layer_input)``; with ``rows`` (keyword
    arguments whose arrays lead with ``x``'s rows: packed documents' segment ids) each
    block is also given them, ``fn(..., **rows)``: a supplied loop that runs the blocks on
    microbatches gives each its own rows (``layer_stack(..., rows=rows)``, with its blocks
    ``block(layer, h, rows)``, ``rows`` empty where the model gives none).

    A block may return ``(x, aux)``, a pytree of auxiliary values that are sums over the
    block's tokens (a mixture of experts' :class:`~shardplug.moe.Tally`): the stack then
    returns ``(x, aux)`` with aux stacked over the layers (a supplied loop that runs the
    blocks on microbatches sums each layer's over them)."""
    params, fn = _made_in_the_loop(params, fn)
    if per_layer is not None:
        params, user = (params, per_layer), fn
        fn = lambda layer, h, **k: user(layer[0], h, layer[1], **k)  # noqa: E731
    rows, keyed = dict(rows or {}), fn
    if rows:
        check_rows(rows, x)
    fn = lambda layer, h, given: keyed(layer, h, **given)  # noqa: E731
    supplied = ops.supplied("layer_stack")
    moved: dict[int, P] = {}
    if supplied is None:
        params, moved = off_the_layers(params)
    with layer_specs(moved):
        gather = layer_gather(params)
    if gather is None:
        block = remat(fn, policy)
    else:  # one checkpoint: the gather and the block, the policy of both in one
        block = regathered(lambda w, h, given: fn(gather(w), h, given), policy)
    layers = layers_of(params)
    if supplied is not None:
        if _takes_rows(supplied):
            return supplied(block, params, x, layers=layers, rows=rows)
        if rows:  # an operation written before rows: its blocks close over them
            warn_once(
                f"this model gives its layer stack rows ({', '.join(sorted(rows))}), and the "
                f"layer stack operation a parallelism of the run supplies "
                f"({getattr(supplied, '__qualname__', type(supplied).__name__)}) takes no "
                f"rows=: its blocks are given the whole batch's, right for a loop over the "
                f"whole batch; one that runs the blocks on microbatches must take rows= "
                f"(shardplug.plugin.LayerStack)"
            )
        return supplied(lambda w, h: block(w, h, rows), params, x, layers=layers)
    h, aux = jax.lax.scan(lambda h, layer: split_aux(block(layer, h, rows)), x, params)
    return h if aux is None else (h, aux)


def _takes_rows(operation: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(operation).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "rows" or p.kind is p.VAR_KEYWORD for p in params)


def check_rows(rows: Mapping[str, Any], x: Any) -> None:
    """``rows``' arrays each lead with ``x``'s rows, or one line says which does not."""
    if not isinstance(rows, Mapping):
        raise ConfigError(
            f"a layer stack's rows are keyword arguments for its blocks, a mapping of name "
            f"to arrays; got {type(rows).__name__}"
        )
    batch = jax.tree.leaves(x)[0].shape[0]
    for name, value in rows.items():
        for leaf in jax.tree.leaves(value):
            if not jnp.ndim(leaf) or jnp.shape(leaf)[0] != batch:
                raise ConfigError(
                    f"a layer stack's rows lead with the batch's {batch} rows (a loop over "
                    f"microbatches gives each its own); {name!r} has shape "
                    f"{tuple(jnp.shape(leaf))}"
                )


def _made_in_the_loop(params: Any, fn: Callable[..., Any]) -> tuple[Any, Callable[..., Any]]:
    """``params`` with each weight made by layer (``layer_gather.made_by_layer``) replaced by
    its parts, and ``fn`` making each layer's weight from them first."""
    leaves, treedef = jax.tree.flatten(params)
    recipes = [made_of(leaf) for leaf in leaves]
    if all(r is None for r in recipes):
        return params, fn
    parts = [leaf if r is None else r[0] for leaf, r in zip(leaves, recipes, strict=True)]

    def made(layer, *rest, **rows):
        weights = [p if r is None else r[1](p) for p, r in zip(layer, recipes, strict=True)]
        return fn(jax.tree.unflatten(treedef, weights), *rest, **rows)

    return parts, rewritten(made, follow)  # products by a made weight run beside it


def off_the_layers(params: Any) -> tuple[Any, dict[int, P]]:
    """On explicit axes, ``params`` with no leaf split along its layers (the dimension a scan
    runs over): the split moved to the first later dimension its axes divide, or, where none
    does, the leaf gathered whole; and the moved leaves' layouts where one layer is used (by
    id, for :func:`shardplug.core.operations.layer_gather.layer_specs`: whole along the moved
    axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not is_explicit(mesh):
        return params, {}
    leaves, treedef = jax.tree.flatten(params)
    out, moved = [], {}
    for leaf in leaves:
        spec = tuple(jax.typeof(leaf).sharding.spec) + (None,) * leaf.ndim
        lead = spec[0]
        if lead is None:
            out.append(leaf)
            continue
        axes = (lead,) if isinstance(lead, str) else tuple(lead)
        size = math.prod(mesh.shape[a] for a in axes)
        used = P(None, *spec[1 : leaf.ndim])
        free = [d for d in range(1, leaf.ndim) if spec[d] is None and leaf.shape[d] % size == 0]
        if not free:
            out.append(jax.sharding.reshard(leaf, used))
            continue
        to = list(spec[: leaf.ndim])
        to[0], to[free[0]] = None, lead
        leaf = jax.sharding.reshard(leaf, P(*to))
        moved[id(leaf)] = used
        out.append(leaf)
    return jax.tree.unflatten(treedef, out), moved


def split_aux(out: Any) -> tuple[Any, Any]:
    """A block's ``(x, aux)`` or ``x`` as a scan's ``(carry, per-layer output)``."""
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)
