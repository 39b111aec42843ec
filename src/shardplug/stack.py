"""Layer stacks: N identical blocks held as one stacked set of parameters, applied by a scan.

A stack's parameters carry a leading layer dimension, named ``layers`` in their logical
annotations. Under every strategy the stack is a ``lax.scan`` over that dimension (one
block compiled once, whatever the depth); under ``pp`` the same call runs the pipeline
schedule, the layer dimension split over the ``stage`` axis. Parameter paths do not depend
on the strategy (``blocks/wq`` with shape ``(layers, ...)``), so a checkpoint written under
``pp`` resumes under ``fsdp`` and back.

A block must be a pure function of its parameters and its input, of the same shape as its
output: no dropout keys, no batch statistics (keep those outside the stack). A block may
return ``(x, aux)``, aux a pytree of sums over its tokens (a mixture of experts'
:class:`~shardplug.moe.Tally`); the stack then returns ``(x, aux)`` with aux stacked per
layer (under ``pp`` each layer's summed over the microbatches).

Flax NNX::

    self.blocks = shardplug.stack.nnx_layers(lambda rngs: Block(rngs=rngs), layers, rngs)
    ...
    x = shardplug.stack.apply(self.blocks, x, remat="dots")

Equinox::

    self.blocks = shardplug.stack.equinox_layers(Block, layers, key)   # Block(key)
    ...
    x = shardplug.stack.apply(self.blocks, x)

Flax Linen (``Block`` a module class, built with no arguments)::

    x = shardplug.stack.LinenLayers(Block, layers, name="blocks")(x)

Any framework, on a pytree of stacked arrays: ``shardplug.stack.scan(fn, params, x)`` with
``fn(layer_params, x) -> x``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
from flax import nnx

from shardplug.core import ops
from shardplug.core.operations.layer_stack import LAYERS, check_rows, run_stack
from shardplug.core.operations.remat import REMAT_POLICIES
from shardplug.errors import ConfigError

__all__ = ["LAYERS", "REMAT_POLICIES", "LinenLayers", "apply", "equinox_layers",
           "nnx_layers", "scan"]  # fmt: skip


def scan(
    fn: Callable[..., Any],
    params: Any,
    x: jax.Array,
    *,
    remat: str = "none",
    per_layer: Any = None,
    rows: Mapping[str, Any] | None = None,
) -> Any:
    """``fn(params[i], x)`` for each layer ``i`` in turn, as a scan (or ``pp``'s schedule).

    :param fn: one block: its parameters (one layer's slice of ``params``) and the input;
        with ``per_layer``, also that layer's slice of it: ``fn(params[i], x, per_layer[i])``.
    :param params: a pytree of arrays with one leading layer dimension.
    :param remat: ``none`` keeps each block's activations for the backward pass, ``full``
        recomputes them, ``dots`` keeps only the weight matrix products' outputs,
        ``offload`` recomputes them from the block's input, kept in host memory.
    :param per_layer: arrays with the same leading dimension that the blocks read but that
        are not trained (model state: a router's balancing bias).
    :param rows: keyword arguments every block is given, ``fn(params[i], x, **rows)``,
        whose arrays lead with ``x``'s rows: packed documents' ``segment_ids`` and
        ``positions``. Pass them here rather than closing the block over them: under ``pp``
        each microbatch's blocks are given that microbatch's rows.
    """
    return run_stack(fn, params, x, remat, per_layer, rows)


def _check_count(layers: int) -> None:
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"a layer stack needs a positive number of layers, got {layers!r}")


def nnx_layers(make_block: Callable[[Any], Any], layers: int, rngs: Any) -> Any:
    """``layers`` NNX blocks as one module whose every variable has a leading layer dimension
    (its sharding names gain ``layers`` in front; a parameter without sharding names gets
    ``("layers", None, ...)``). ``make_block(rngs)`` builds one block."""
    _check_count(layers)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(rngs):
        return make_block(rngs)

    blocks = build(rngs)
    for _, variable in nnx.iter_graph(blocks):  # a block written without sharding names
        if isinstance(variable, nnx.Param) and "out_sharding" not in variable.get_metadata():
            rest = (None,) * (variable.get_value().ndim - 1)
            variable.set_metadata(out_sharding=(LAYERS, *rest))
    return blocks


def equinox_layers(make_block: Callable[[jax.Array], Any], layers: int, key: jax.Array) -> Any:
    """``layers`` Equinox blocks as one module whose arrays have a leading layer dimension.
    ``make_block(key)`` builds one block. Its sharding rules name the extra dimension:
    ``r"blocks/wq": ("layers", "embed", "heads", "kv")``."""
    _check_count(layers)
    return eqx.filter_vmap(make_block)(jax.random.split(key, layers))


def apply(stack: Any, x: jax.Array, *, remat: str = "none", per_layer: Any = None,
          rows: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
    """Run an NNX or Equinox stack (from :func:`nnx_layers` / :func:`equinox_layers`) on ``x``;
    with ``per_layer`` each block is called ``block(x, per_layer[i])``, with ``rows``
    ``block(x, **rows)`` (see :func:`scan`)."""
    if isinstance(stack, nnx.Module):
        graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ConfigError(
                "a layer stack's blocks may hold only nnx.Param variables (found batch "
                "statistics or random state): keep dropout and BatchNorm outside the stack"
            )
        return scan(lambda p, *h, **k: nnx.merge(graphdef, p, rest)(*h, **k), params, x,
                    remat=remat, per_layer=per_layer, rows=rows)  # fmt: skip
    if isinstance(stack, eqx.Module):
        params, static = eqx.partition(stack, eqx.is_array)
        return scan(lambda p, *h, **k: eqx.combine(p, static)(*h, **k), params, x,
                    remat=remat, per_layer=per_layer, rows=rows)  # fmt: skip
    raise ConfigError(
        f"shardplug.stack.apply takes a stack from nnx_layers or equinox_layers, got "
        f"{type(stack).__name__}; for Linen use shardplug.stack.LinenLayers"
    )


class LinenLayers(nn.Module):
    """``layers`` copies of the Linen module ``block`` (a class or a no-argument factory),
    their parameters stacked under this module's name with ``layers`` leading."""

    block: Callable[..., nn.Module]
    layers: int
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jax.Array, per_layer: Any = None,
                 rows: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
        """The stack on ``x``; with ``per_layer``, ``block(x, per_layer[i])``, with ``rows``
        ``block(x, **rows)`` (:func:`scan`)."""
        _check_count(self.layers)
        one = self.block(parent=None)
        if rows:
            check_rows(rows, x)
        first = jax.tree.map(lambda a: a[:1], dict(rows or {}))

        def init(k):
            return one.init(k, x[:1], **first)["params"]

        shapes = jax.eval_shape(init, jax.random.key(0))

        def build(key, name):
            keys = jax.random.split(key, self.layers)
            with ops.plain():  # each layer's parameters as one device makes them: a
                # parallelism's collectives (grouped all-to-alls) need not run under vmap
                return _prepend_layers(jax.vmap(lambda k: init(k)[name])(keys))

        params = {name: self.param(name, build, name) for name in shapes}
        return scan(lambda p, *h, **k: one.apply({"params": p}, *h, **k), params, x,
                    remat=self.remat, per_layer=per_layer, rows=rows)  # fmt: skip


def _prepend_layers(tree: Any) -> Any:
    def add(leaf):
        if isinstance(leaf, nn.Partitioned):
            return leaf.replace(names=(LAYERS, *leaf.names))
        return leaf

    return jax.tree.map(add, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
