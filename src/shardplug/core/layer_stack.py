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


def run_stack(fn: Callable[..., Any], params: Any, x: jax.Array, policy: str = "none",
              per_layer: Any = None) -> Any:  # fmt: skip
    """Apply ``fn(layer_params, x)`` for each layer of ``params`` in turn (see the module);
    with ``per_layer`` (a pytree of arrays with the same leading dimension, not trained: a
    router's balancing bias) ``fn(layer_params, x, layer_input)``.

    A block may return ``(x, aux)``, a pytree of auxiliary values that are sums over the
    block's tokens (a mixture of experts' :class:`~shardplug.moe.Tally`): the stack then
    returns ``(x, aux)`` with aux stacked over the layers, each layer's summed over pp's
    microbatches."""
    if per_layer is not None:
        params, user = (params, per_layer), fn
        fn = lambda layer, h: user(layer[0], h, layer[1])  # noqa: E731
    gather = layer_gather(params)
    if gather is None:
        block = remat(fn, policy)
    else:  # one checkpoint: the gather and the block, the policy of both in one
        block = regathered(lambda w, h: fn(gather(w), h), policy)
    layers = layers_of(params)
    pipeline = schedule.active()
    if pipeline is None:
        h, aux = jax.lax.scan(lambda h, layer: schedule.split_aux(block(layer, h)), x, params)
        return h if aux is None else (h, aux)
    pipeline = pipeline.split_over(schedule.rows_split(x)).resolve(x.shape[0])
    pipeline.check(layers, x.shape[0])
    return schedule.schedule(block, params, x, pipeline, layers)
