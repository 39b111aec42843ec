"""The traced step: state, the loss protocol, microbatches, precision, explicit reduction.

Everything here runs inside ``jax.jit`` (or a per-device program) when the step is traced;
nothing here touches the host loop. The strategy is asked where things live and how devices
meet; the model is reached through its adapter's ``bind`` and ``state_of``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardplug.core import means, memory, ops
from shardplug.core.context import batch_axis_name, computing_in, manual_axes
from shardplug.core.mesh import is_explicit
from shardplug.core.operations import beside
from shardplug.core.operations.held import held, said_outside_stacks
from shardplug.core.operations.layer_gather import layer_specs
from shardplug.core.operations.roles import Role, roles_in
from shardplug.core.precision import PRECISIONS as PRECISIONS  # where explain reads it
from shardplug.core.precision import Precision
from shardplug.core.precision import cast_floats as _cast_floats
from shardplug.core.precision import compute_dtype as _compute_dtype
from shardplug.core.registry import Strategy
from shardplug.core.shard_grads import per_shard_grads, rows_only
from shardplug.core.sharding import lay_out, leaf_paths
from shardplug.core.update import updated
from shardplug.errors import ConfigError

LossFn = Callable[..., Any]


class ModelAdapter(Protocol):
    """What the step needs of a model adapter (:class:`shardplug.Adapter` implements it)."""

    def bind(self, params: Any, state: Any, *, rng: Any, train: bool) -> Any: ...

    def state_of(self, model: Any, state: Any) -> Any: ...


class TrainState(NamedTuple):
    """Everything one step reads and writes; a pytree of global arrays."""

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array  # the run's key; step s uses jax.random.fold_in(rng, s)


def step_key(state: TrainState) -> jax.Array:
    """This step's key: the same on every device and under every strategy."""
    return jax.random.fold_in(state.rng, state.step)


EXTRAS = ("rng", "train", "state")


def loss_extras(loss_fn: LossFn) -> frozenset[str]:
    """Which of ``rng``, ``train`` and ``state`` the loss function takes by name."""
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r}: give a function loss_fn(model, batch)")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return frozenset()
    params = signature.parameters
    try:  # the model and the batch, by position
        signature.bind(None, None, **{k: None for k in EXTRAS if k in params})
    except TypeError:
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise ConfigError(f"loss_fn {name}{signature} cannot be called as loss_fn(model, batch): "
                          "take the model and the batch, in that order") from None  # fmt: skip
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return frozenset(EXTRAS)
    return frozenset(name for name in EXTRAS if name in params)


def _split_loss(out: Any) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """``loss``, ``(loss, metrics)`` or ``(loss, metrics, new_state)``."""
    parts = out if isinstance(out, tuple) else (out,)
    if not 1 <= len(parts) <= 3 or (len(parts) > 1 and not isinstance(parts[1], Mapping)):
        raise ConfigError(
            "loss_fn must return a loss, (loss, dict of metrics) or (loss, metrics, new state)"
        )
    loss, counts = parts[0], {}
    if isinstance(loss, means.Mean):
        loss, counts[means.weight_key()] = means.declared("the loss", loss)
    if not hasattr(loss, "shape"):  # a Python number depends on no parameter: nothing trains
        what = f"the Python number {loss!r}" if isinstance(loss, int | float) else type(
            loss).__name__  # fmt: skip
        raise ConfigError(f"loss_fn must return the loss as a scalar array computed from the "
                          f"model, got {what}")  # fmt: skip
    if jnp.shape(loss) != ():
        raise ConfigError(
            f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}: average it"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):  # no gradient: grad raises TypeError
        raise ConfigError(f"loss_fn must return a floating-point loss, got {loss.dtype}: "
                          "compute it in floats (an argmax has no gradient)")  # fmt: skip
    metrics = dict(parts[1]) if len(parts) > 1 else {}
    for name, value in list(metrics.items()):
        if isinstance(value, means.Mean):
            value, counts[means.weight_key(name)] = means.declared(f"metric {name!r}", value)
            metrics[name] = value
        if not hasattr(value, "shape") and not isinstance(value, int | float):
            raise ConfigError(f"metric {name!r} is a {type(value).__name__}: give a scalar array")
        if jnp.shape(value) != ():
            raise ConfigError(
                f"metric {name!r} has shape {jnp.shape(value)}: metrics must be scalars "
                "(average it)"
            )
    return loss, {**metrics, **counts}, parts[2] if len(parts) == 3 else None


def _forward(adapter, loss_fn, extras, params, model_state, rng, batch, train):
    """Bind the model, run the loss; ``loss, (metrics, new model state)``."""
    model = adapter.bind(params, model_state, rng=rng, train=train)
    given = {"rng": rng, "train": train, "state": model_state}
    loss, metrics, new_state = _split_loss(
        loss_fn(model, batch, **{k: v for k, v in given.items() if k in extras})
    )
    if new_state is None:
        new_state = adapter.state_of(model, model_state)
    elif hasattr(new_state, "shape") or isinstance(new_state, int | float):
        # an array or a number is no model state (a state is the model's own tree; it is
        # not flattened here: Equinox's refuses to be read twice)
        raise ConfigError(
            "loss_fn returned three values, read as (loss, metrics, new model state), and its "
            "third is an array, not the model's state: return (loss, metrics), or the "
            "model's new state third (its batch statistics, as Equinox threads them)"
        )
    return loss, (metrics, new_state)


def _held_forward(holds, adapter, loss_fn, extras, params, *rest):
    """:func:`_forward` with the weights ``holds`` names held (marked inside the trace the
    rewrite runs, so a layer stack finds its weights' by their traced arrays)."""
    if holds is None:
        return _forward(adapter, loss_fn, extras, params, *rest)
    params, marked = held(params, holds)
    out = _forward(adapter, loss_fn, extras, params, *rest)
    if ops.supplied("layer_stack") is not None:  # the rest of the forward pass is not rewritten
        said_outside_stacks(marked)
    return out


NONFINITE = "_nonfinite"


def make_step(
    adapter: ModelAdapter,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    strategy: Strategy,
    mesh: Any,
    *,
    param_shardings: Any = None,
    batch_shardings: Any = None,
    skip_nonfinite: bool = False,
    grad_accum: int = 1,
    precision: Precision = "float32",
    loss_normalised: bool = False,
    placed: TrainState | None = None,
    update_on_host: bool = False,
    roles: Any = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """One optimizer step on the global batch: loss, gradients, ``reduce_grads``, update.

    With ``grad_accum`` K > 1 the batch is cut into K microbatches (rows ``k, k+K, ...``, so
    each stays spread over every device) whose gradients are computed one after another in a
    ``lax.scan`` and averaged: the update of the whole batch, with the activations of one
    microbatch. With ``precision="bfloat16"`` the forward and backward passes run on
    bfloat16 copies of the parameters and of the batch's floating-point leaves; the
    parameters, gradients and optimizer state stay float32.

    A non-finite loss is seen by the host, in the metrics it reads. With ``skip_nonfinite``
    the step judges itself: it checks the loss and the gradient's norm (a reduction over
    every parameter, which costs a few percent of a small model's step on a CPU), and a step
    with either NaN or infinite leaves the parameters, optimizer state and model state as
    they were (the step count and the data still advance) and says so in the metric
    ``NONFINITE`` (1.0). Without it, a non-finite gradient shows in the next step's loss.

    When the strategy or an add-on implements ``encode_grads``, the gradient reduction is
    made explicit: each device's gradient is computed, encoded, summed in the encoded dtype
    and cast back. Under ``jax.jit`` that needs the parameter and batch shardings.

    A loss returned as a :class:`shardplug.Mean` is summed and counted over whatever parts
    the step cuts the batch into, then divided once; ``loss_normalised`` (an undeclared loss
    that divides by a count taken from the batch: :func:`trace_loss`,
    :func:`shardplug.core.means.divides_by_data`) has the step say so where it averages its
    parts' means.

    ``placed``: the state's shardings, where some arrays live off the devices (the
    ``place_state`` hook): the parameters and model state are brought to the devices for
    the forward pass, the optimizer state for the update (after the backward pass has
    freed its activations); the new values go back through the program's outputs. With
    ``update_on_host`` the update runs in host memory instead, next to the optimizer state
    (:func:`shardplug.core.memory.update_on_host`).

    ``roles``: each parameter's role in the step (:func:`weight_roles`), for an add-on's
    default targets (the ``held_weights`` hook).
    """
    encodes = strategy.encodes_grads
    # an adapter's merged weights: each shard's gradient contracted to its factors first
    # (not on explicit axes, where a vmap over the shards refuses weights split along them)
    per_shard = encodes or (
        getattr(adapter, "reduce_per_shard", False) and batch_shardings is not None
        and rows_only(batch_shardings) and not is_explicit(mesh)
    )  # fmt: skip
    compute = _compute_dtype(precision)

    prepare, forward, value_and_grad = _differentiated(adapter, loss_fn, strategy, mesh,
                                                       compute, roles)  # fmt: skip

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        with means.normalised(loss_normalised):
            return traced(state, batch)

    def traced(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        rng = step_key(state)
        axis = batch_axis_name()  # set inside a per-device program
        given, state = state, memory.brought(state, placed, axis, "params", "model_state")
        plain = axis is None and not per_shard  # under jit, the compiler places the reduction
        grad_fn = _accumulate(value_and_grad, grad_accum, batch_shardings if plain else None)
        owned = strategy.compute_grads(
            loss_and_grad=value_and_grad, params=state.params, model_state=state.model_state,
            batch=batch, rng=rng, mesh=mesh, microbatches=grad_accum,
            prepare=prepare, forward=forward, param_shardings=param_shardings,
        )  # fmt: skip
        loss, metrics, model_state, grads = _gradients(
            owned, grad_fn, value_and_grad, strategy, mesh, state, batch, rng, axis=axis,
            per_shard=per_shard, encodes=encodes, grad_accum=grad_accum,
            param_shardings=param_shardings, batch_shardings=batch_shardings,
        )  # fmt: skip
        out = {"loss": loss, **means.reported(metrics)}
        finite = _judged(loss, grads, out) if skip_nonfinite else None  # before the update
        params, opt_state, model_state = updated(
            optimizer, grads, state, given, model_state, finite, placed=placed, axis=axis,
            update_on_host=update_on_host,
        )  # fmt: skip
        frozen = adapter.trainable(given.params)
        if frozen is not None:  # a frozen parameter stays as it was, whatever the optimizer
            params = jax.tree.map(lambda new, old, t: new if t else old, params, given.params,
                                  frozen)  # fmt: skip
        new = TrainState(state.step + 1, params, opt_state, model_state, state.rng)
        return new, out

    return step


def _differentiated(adapter: ModelAdapter, loss_fn: LossFn, strategy: Strategy, mesh: Any,
                    compute: Any, roles: Any = None,
                    ) -> tuple[Callable, Callable, Callable]:  # fmt: skip
    """The step's ``prepare`` (the parameters cast to the compute dtype and gathered as the
    strategy says), ``forward`` (the loss of the prepared parameters, its products by an
    adapter's made weights beside them) and ``value_and_grad`` of both."""
    extras = loss_extras(loss_fn)
    # The model state is an argument, not a closure: frameworks that update it in place
    # (NNX's BatchStat) must see it at the level of the gradient's trace.
    per_layer: dict[int, Any] = {}  # of the prepared stacks gathered a layer at a time

    def prepare(params):
        if compute is not None:  # cast before gathering: all-gathers move half the bytes
            params = _cast_floats(params, compute)
        params, gathered = strategy.gather_for_step(params, mesh)
        per_layer.clear()  # ids of this trace's arrays alone
        per_layer.update(gathered)
        return params

    def forward(params, model_state, batch, rng):  # the parameters as prepare gives them
        if compute is not None:
            batch = _cast_floats(batch, compute)
        with computing_in(compute), layer_specs(per_layer):
            beside_ = getattr(adapter, "beside", False)  # its weights' roles are the base's
            holds = strategy.held_weights(params, mesh, None if beside_ else roles)  # float8's
            if holds is not None and beside_:
                raise ConfigError(
                    f"{next(h.kind for h in holds if h)} runs the products of the model's "
                    f"weights, and adapters on them (LoRA) run beside them: train with one "
                    f"of the two"
                )
            return beside.forward(adapter, _held_forward, holds, adapter, loss_fn, extras,
                                  params, model_state, rng, batch, True,
                                  held=holds is not None)  # fmt: skip

    def loss_of(params, model_state, batch, rng):
        return forward(prepare(params), model_state, batch, rng)

    differentiated = jax.value_and_grad(loss_of, has_aux=True, allow_int=True)

    def value_and_grad(params, *rest):  # a frozen integer parameter's (a quantized base's):
        out, grads = differentiated(params, *rest)  # zero, of its own dtype, not float0
        return out, jax.tree.map(_zero_if_integer, grads, params)

    return prepare, forward, value_and_grad


def _judged(loss: Any, grads: Any, out: dict[str, Any]) -> Any:
    """Whether the loss and the gradient's norm are finite (every device of every manual
    axis deciding alike), said in ``out``'s :data:`NONFINITE`."""
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    if manual_axes():  # per device: every device of every manual axis decides alike
        finite = jax.lax.pmin(finite.astype(jnp.int32), manual_axes()).astype(bool)
    out[NONFINITE] = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
    return finite


def _gradients(owned: Any, grad_fn: Callable, value_and_grad: Callable, strategy: Strategy,
               mesh: Any, state: TrainState, batch: Any, rng: Any, *, axis: str | None,
               per_shard: bool, encodes: bool, grad_accum: int, param_shardings: Any,
               batch_shardings: Any) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """The step's ``(loss, metrics, model state, gradient)``, reduced: a parallelism's own
    (``owned``, it scheduled the microbatches), each shard's explicitly (``per_shard``
    under jit), or autodiff's over the whole batch (or each device's rows)."""
    if owned is not None:  # a parallelism schedules the microbatches itself
        (loss, (metrics, model_state)), grads = owned
        if encodes:
            grads = strategy.encode_grads(grads, mesh)
    elif per_shard and axis is None:  # under jit: each shard's gradient, explicitly
        try:
            loss, metrics, model_state, grads = per_shard_grads(
                grad_fn, strategy, mesh, state, batch, rng, param_shardings,
                batch_shardings, encodes,
            )  # fmt: skip
        except NotImplementedError:  # an op JAX has no batching rule for
            if encodes:
                raise
            grad_fn = _accumulate(value_and_grad, grad_accum, batch_shardings)
            (loss, (metrics, model_state)), grads = grad_fn(
                state.params, state.model_state, batch, rng
            )
    else:
        (loss, (metrics, model_state)), grads = grad_fn(
            state.params, state.model_state, batch, rng
        )
        if axis is not None and means.weighted(metrics):  # the devices' parts averaged
            loss, metrics, grads = means.reweigh(loss, metrics, grads, axis)
        elif axis is not None:
            means.part_means("each device's rows, a per-device program")
        if encodes:
            grads = strategy.encode_grads(grads, mesh)
    grads = strategy.reduce_grads(grads, mesh)
    if encodes:
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return loss, metrics, model_state, grads


def _zero_if_integer(grad: Any, param: Any) -> Any:
    """An integer parameter's gradient (``float0``) as zeros of its dtype: an update that
    leaves it as it is, through every reduction and optimizer."""
    if grad.dtype == jax.dtypes.float0:
        return jnp.zeros(param.shape, param.dtype, out_sharding=jax.typeof(param).sharding)
    return grad


def _accumulate(value_and_grad: Callable, k: int, batch_shardings: Any) -> Callable:
    """``value_and_grad`` over ``k`` microbatches in turn: the mean loss, metrics and gradient.

    Microbatch ``i`` takes rows ``i, i+k, i+2k, ...`` of every leaf, so each microbatch is
    split over the devices as the whole batch is (``batch_shardings`` pins that under jit);
    its dropout key is the step's key folded with ``i``. The model state (batch statistics)
    passes from one microbatch to the next. A loss declared as a :class:`Mean` is summed and
    counted over the microbatches and divided once; an undeclared one that divides by a count
    taken from the batch is told so, once (:func:`shardplug.core.means.part_means`).
    """
    if k == 1:
        return value_and_grad

    def accumulated(params, model_state, batch, rng):
        def split(x):
            if not np.ndim(x):
                return jnp.broadcast_to(x, (k,))
            return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)

        def body(carry, inputs):
            total, model_state = carry
            i, rows = inputs
            if batch_shardings is not None:
                rows = lay_out(rows, batch_shardings)
            key = jax.random.fold_in(rng, i)
            (loss, (metrics, model_state)), grads = value_and_grad(params, model_state, rows, key)
            count = means.grad_scale(metrics)
            if count is not None:  # a declared loss: this part's share of the sum
                grads = jax.tree.map(lambda g: g * count.astype(g.dtype), grads)
                loss, metrics = means.part_sums(loss, metrics)
            total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
            return (total, model_state), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        (total, model_state), (losses, metrics) = jax.lax.scan(
            body, (zeros, model_state), (jnp.arange(k), jax.tree.map(split, batch))
        )
        if means.weighted(metrics):  # the parts' sums and counts added, then divided once
            loss, metrics = means.combine(losses.sum(0), jax.tree.map(jnp.sum, metrics), k)
            return (loss, (metrics, model_state)), means.divided(total, metrics, k)
        means.part_means(f"{k} microbatches, --grad-accum")
        grads = jax.tree.map(lambda g: g / k, total)
        return (jnp.mean(losses), (jax.tree.map(jnp.mean, metrics), model_state)), grads

    return accumulated


def trace_loss(adapter: Any, loss_fn: LossFn, batch: Any, mesh: Any = None) -> Any:
    """The model's loss on ``batch`` (its global shapes) traced alone: no strategy, on
    abstract parameters, nothing run (a ``ClosedJaxpr`` whose inputs are the parameters', the
    model state's and the batch's leaves, in that order): what the model computes, for its
    FLOPs and its normaliser. ``mesh``: the run's, for a model whose code names its axes."""
    key = jax.random.key(0)
    params, state = adapter.abstract(key)
    extras = loss_extras(loss_fn)

    def forward(params: Any, state: Any, batch: Any) -> Any:
        return _forward(adapter, loss_fn, extras, params, state, key, batch, True)[0]

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    if mesh is None:
        return jax.make_jaxpr(forward)(params, state, shapes)
    with jax.set_mesh(mesh):
        return jax.make_jaxpr(forward)(params, state, shapes)


def weight_roles(adapter: Any, loss_fn: LossFn, batch: Any, mesh: Any = None) -> dict[str, Role]:
    """What each parameter does in the model's loss on ``batch``, by its path: a ``Role(kind,
    why)`` (:mod:`shardplug.core.operations.roles`: ``"head"``, ``"embedding"``, ``"router"``,
    ``"grouped"``, ``"convolution"``, ``"linear"`` or ``"elementwise"``), read from the
    traced loss whatever the parameters are named: LoRA's and float8's default targets."""
    params, _ = adapter.abstract(jax.random.key(0))
    return roles_in(trace_loss(adapter, loss_fn, batch, mesh), leaf_paths(params))


def make_eval_step(
    adapter: ModelAdapter,
    loss_fn: LossFn,
    strategy: Strategy,
    mesh: Any,
    placed: TrainState | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The loss and metrics of the model in evaluation mode; the state passes through (the
    parameters and model state brought to the devices where ``placed`` keeps them off)."""
    extras = loss_extras(loss_fn)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        given = state
        state = memory.brought(state, placed, batch_axis_name(), "params", "model_state")
        params, per_layer = strategy.gather_for_step(state.params, mesh)
        with layer_specs(per_layer):
            loss, (metrics, _) = _forward(
                adapter, loss_fn, extras, params, state.model_state, step_key(state), batch, False
            )
        axis = batch_axis_name()
        if axis is not None and means.weighted(metrics):  # the devices' parts averaged
            loss, metrics, _ = means.reweigh(loss, metrics, None, axis)
        return given, {"loss": loss, **metrics}  # with the counts: batches are weighed by them

    return step


def key_impl(x: Any) -> Any:
    """A PRNG key array's implementation, None for any other leaf."""
    is_key = hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    if is_key and isinstance(x, jax.ShapeDtypeStruct):  # a planned state's key
        return jax.random.key_impl(jax.random.key(0, impl=x.dtype._impl.name))
    return jax.random.key_impl(x) if is_key else None


def wrap_keys(leaves: list[Any], impls: list[Any]) -> list[Any]:
    """Leaves with each PRNG key's data (``impls[i]`` not None) wrapped back into a key."""
    return [
        x if impl is None else jax.random.wrap_key_data(x, impl=impl)
        for x, impl in zip(leaves, impls, strict=True)
    ]


def unwrap_keys(leaves: list[Any], impls: list[Any]) -> list[Any]:
    """Leaves with each PRNG key as its key data: a plain array the host passes cheaply."""
    return [x if impl is None else _key_data(x) for x, impl in zip(leaves, impls, strict=True)]


def _key_data(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):  # a planned state's key: its data's shape
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    return jax.random.key_data(x)
