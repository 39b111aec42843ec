"""A layer stack applied by a scan: what :mod:`shardplug.stack` calls under every strategy.

:func:`run_stack` is a ``lax.scan`` over the stack's leading (layer) dimension, each block
rematerialised by the policy asked for (:mod:`shardplug.core.remat`); its layers gathered
one at a time where fsdp split them (:mod:`shardplug.core.layer_gather`); and, while a
pipeline is active, pp's schedule over the ``stage`` axis instead of the scan
(:mod:`shardplug.core.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardplug.core import schedule
from shardplug.core.layer_gather import layer_gather, regathered
from shardplug.core.remat import remat
from shardplug.errors import ConfigError

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


def _split(out: Any) -> tuple[Any, Any]:
    """A block's ``(x, aux)`` or ``x`` as scan's ``(carry, per-layer output)``."""
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


def _no_aux(block: Callable) -> Callable:
    def checked(layer: Any, h: jax.Array) -> jax.Array:
        out = block(layer, h)
        if isinstance(out, tuple):
            raise ConfigError(
                "this layer stack's blocks return auxiliary values (x, aux) (a mixture of "
                "experts' losses), which pp's schedule does not carry yet: train it without pp"
            )
        return out

    return checked


def run_stack(fn: Callable[[Any, jax.Array], Any], params: Any, x: jax.Array,
              policy: str = "none") -> Any:  # fmt: skip
    """Apply ``fn(layer_params, x)`` for each layer of ``params`` in turn (see the module).
    A block may return ``(x, aux)``, a pytree of auxiliary values (a mixture of experts'
    losses and load): the stack then returns ``(x, the sum of aux over the layers)``."""
    gather = layer_gather(params)
    if gather is None:
        block = remat(fn, policy)
    else:  # one checkpoint: the gather and the block, the policy of both in one
        block = regathered(lambda w, h: fn(gather(w), h), policy)
    layers = layers_of(params)
    pipeline = schedule.active()
    if pipeline is None:
        h, aux = jax.lax.scan(lambda h, layer: _split(block(layer, h)), x, params)
        return h if aux is None else (h, jax.tree.map(lambda a: a.sum(0), aux))
    block = _no_aux(block)
    pipeline = pipeline.split_over(schedule.rows_split(x)).resolve(x.shape[0])
    pipeline.check(layers, x.shape[0])
    return schedule.schedule(block, params, x, pipeline, layers)
