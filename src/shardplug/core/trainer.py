"""The trainer: owns the loop, asks the strategy where things live and how devices meet."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import json
import math
import os
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.context import batch_axis_name, per_device_program
from shardplug.core.devices import select_devices
from shardplug.core.mesh import parse_mesh
from shardplug.core.registry import Strategy, get_strategy
from shardplug.core.sharding import leading_axes, optimizer_shardings
from shardplug.errors import (
    BatchError,
    CheckpointError,
    ConfigError,
    NonFiniteError,
    PluginError,
    TrainingInterrupted,
)
from shardplug.models.adapter import Adapter

LossFn = Callable[[Any, Any], Any]


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


class _Program(NamedTuple):
    """A compiled step and the batches it was compiled for."""

    compiled: Any
    batch_shardings: Any
    signature: Any


EXTRAS = ("rng", "train", "state")


def loss_extras(loss_fn: LossFn) -> frozenset[str]:
    """Which of ``rng``, ``train`` and ``state`` the loss function takes by name."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return frozenset()
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
    loss = parts[0]
    if jnp.shape(loss) != ():
        raise ConfigError(
            f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}: average it"
        )
    metrics = dict(parts[1]) if len(parts) > 1 else {}
    return loss, metrics, parts[2] if len(parts) == 3 else None


def _forward(adapter, loss_fn, extras, params, model_state, rng, batch, train):
    """Bind the model, run the loss; ``loss, (metrics, new model state)``."""
    model = adapter.bind(params, model_state, rng=rng, train=train)
    given = {"rng": rng, "train": train, "state": model_state}
    loss, metrics, new_state = _split_loss(
        loss_fn(model, batch, **{k: v for k, v in given.items() if k in extras})
    )
    if new_state is None:
        new_state = adapter.state_of(model, model_state)
    return loss, (metrics, new_state)


SHARD_AXIS = "shards"


def make_step(
    adapter: Adapter,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    strategy: Strategy,
    mesh: Any,
    *,
    param_shardings: Any = None,
    batch_shardings: Any = None,
    skip_nonfinite: bool = False,
    grad_accum: int = 1,
    precision: str = "float32",
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
    """
    extras = loss_extras(loss_fn)
    encodes = strategy.encodes_grads
    compute = _compute_dtype(precision)

    # The model state is an argument, not a closure: frameworks that update it in place
    # (NNX's BatchStat) must see it at the level of the gradient's trace.
    def loss_of(params, model_state, batch, rng):
        if compute is not None:  # cast before gathering: fsdp's all-gathers move half the bytes
            params, batch = _cast_floats((params, batch), compute)
        params = strategy.gather_params(params, mesh)
        return _forward(adapter, loss_fn, extras, params, model_state, rng, batch, True)

    value_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        rng = step_key(state)
        axis = batch_axis_name()  # set inside a per-device program (pmap)
        plain = axis is None and not encodes  # under jit, the compiler places the reduction
        grad_fn = _accumulate(value_and_grad, grad_accum, batch_shardings if plain else None)
        if encodes and axis is None:  # under jit: each shard's gradient, explicitly
            loss, metrics, model_state, grads = _per_shard_grads(
                grad_fn, strategy, mesh, state, batch, rng, param_shardings, batch_shardings
            )
        else:
            (loss, (metrics, model_state)), grads = grad_fn(
                state.params, state.model_state, batch, rng
            )
            if encodes:
                grads = strategy.encode_grads(grads, mesh)
        grads = strategy.reduce_grads(grads, mesh)
        if encodes:
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        out = {"loss": loss, **metrics}
        if skip_nonfinite:  # the update must be judged before it is applied
            finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
            if axis is not None:  # per device: every device must decide alike
                finite = jax.lax.pmin(finite.astype(jnp.int32), axis).astype(bool)
            params, opt_state, model_state = jax.tree.map(
                functools.partial(_keep_if_not, finite),
                (params, opt_state, model_state),
                (state.params, state.opt_state, state.model_state),
            )
            out[NONFINITE] = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
        new = TrainState(state.step + 1, params, opt_state, model_state, state.rng)
        return new, out

    return step


NONFINITE = "_nonfinite"

# Steps the loop lets run ahead of the devices. Enough to keep them busy; a deeper queue
# only holds more batches in memory, and on the CPU backend a deep queue of programs with
# collectives can starve its thread pool until a rendezvous times out (seen at ~100).
MAX_IN_FLIGHT = 4

PRECISIONS = {"float32": None, "fp32": None, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def _compute_dtype(precision: str) -> Any:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def _cast_floats(tree: Any, dtype: Any) -> Any:
    """Every float32 array of ``tree`` as ``dtype``; other arrays (integers, keys) as they are."""

    def cast(x):
        if hasattr(x, "dtype") and x.dtype == jnp.float32:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def _accumulate(value_and_grad: Callable, k: int, batch_shardings: Any) -> Callable:
    """``value_and_grad`` over ``k`` microbatches in turn: the mean loss, metrics and gradient.

    Microbatch ``i`` takes rows ``i, i+k, i+2k, ...`` of every leaf, so each microbatch is
    split over the devices as the whole batch is (``batch_shardings`` pins that under jit);
    its dropout key is the step's key folded with ``i``. The model state (batch statistics)
    passes from one microbatch to the next.
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
                rows = jax.lax.with_sharding_constraint(rows, batch_shardings)
            key = jax.random.fold_in(rng, i)
            (loss, (metrics, model_state)), grads = value_and_grad(params, model_state, rows, key)
            total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
            return (total, model_state), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        (total, model_state), (losses, metrics) = jax.lax.scan(
            body, (zeros, model_state), (jnp.arange(k), jax.tree.map(split, batch))
        )
        grads = jax.tree.map(lambda g: g / k, total)
        return (jnp.mean(losses), (jax.tree.map(jnp.mean, metrics), model_state)), grads

    return accumulated


def _keep_if_not(finite: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        return new
    return jnp.where(finite, new, old)


def _batch_split(batch_shardings: Any) -> tuple[tuple[str, ...], Any]:
    """The mesh axes the batch's leading dimension is split over, and which leaves are."""
    found: set[tuple[str, ...]] = set()

    def axes_of(sharding: NamedSharding) -> tuple[str, ...]:
        if any(entry is not None for entry in tuple(sharding.spec)[1:]):
            raise ConfigError(
                "encode_grads needs the batch split along its leading dimension only; "
                f"strategy gave {sharding.spec}"
            )
        axes = leading_axes(sharding.spec)
        if axes:
            found.add(axes)
        return axes

    split = jax.tree.map(lambda s: bool(axes_of(s)), batch_shardings)
    if len(found) > 1:
        raise ConfigError(
            f"encode_grads needs every batch leaf split over the same mesh axes, got {found}"
        )
    return (found.pop() if found else ()), split


def _per_shard_grads(grad_fn, strategy, mesh, state, batch, rng, param_shardings, batch_shardings):
    """Under ``jax.jit``: each batch shard's gradient, encoded, then summed across shards.

    The batch's leading dimension (split over the axes A) is reshaped to ``(shards, rows)``
    and the step is vmapped over the shards, so each device computes the gradient of its own
    rows, with no communication. The encoded gradients are summed over the shard axis: the
    compiler turns that sum into the all-reduce (or reduce-scatter) over A, in the encoded
    dtype. The vmap's axis is the models' ``batch_axis_name()``, so batch statistics and
    dropout masks stay those of the global batch.
    """
    axes, split = _batch_split(batch_shardings)
    n = math.prod(mesh.shape[a] for a in axes)
    lead = axes if axes else None

    def to_shards(x, is_split):
        if not is_split:
            return x
        x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        spec = P(lead, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    shards = jax.tree.map(to_shards, batch, split)
    in_axes = jax.tree.map(lambda s: 0 if s else None, split)

    def one_shard(params, model_state, rows):
        out, grads = grad_fn(params, model_state, rows, rng)
        return out, strategy.encode_grads(grads, mesh)

    with per_device_program(SHARD_AXIS):
        (loss, (metrics, model_state)), encoded = jax.vmap(
            one_shard, in_axes=(None, None, in_axes), axis_name=SHARD_AXIS
        )(state.params, state.model_state, shards)

    def stacked(g, sharding):
        # each device keeps its own shard's whole gradient until the reduction
        rest = [_without(entry, axes) for entry in sharding.spec]
        rest += [None] * (g.ndim - 1 - len(rest))
        return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P(lead, *rest)))

    def mean_over_shards(g, sharding):
        total = jax.lax.reduce(g, np.zeros((), g.dtype), jax.lax.add, (0,))  # no upcast
        total = total / np.asarray(n, g.dtype)
        return jax.lax.with_sharding_constraint(total, sharding)

    encoded = jax.tree.map(stacked, encoded, param_shardings)
    grads = jax.tree.map(mean_over_shards, encoded, param_shardings)
    # Batch statistics were averaged over the shards inside; take the mean once more so a
    # model that does not ask for batch_axis_name() gets the shards' average.
    model_state = jax.tree.map(_shard_mean, model_state)
    return jnp.mean(loss), jax.tree.map(jnp.mean, metrics), model_state, grads


def _shard_mean(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


def _without(entry: Any, axes: tuple[str, ...]) -> Any:
    """A partition-spec entry with the batch axes taken out."""
    if entry is None:
        return None
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def make_eval_step(
    adapter: Adapter, loss_fn: LossFn, strategy: Strategy, mesh: Any
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The loss and metrics of the model in evaluation mode; the state passes through."""
    extras = loss_extras(loss_fn)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        params = strategy.gather_params(state.params, mesh)
        loss, (metrics, _) = _forward(
            adapter, loss_fn, extras, params, state.model_state, step_key(state), batch, False
        )
        return state, {"loss": loss, **metrics}

    return step


class Trainer:
    """Trains a model on many devices with a strategy chosen by name.

    :param adapter: the model, from :func:`shardplug.from_nnx` (or another adapter).
    :param loss_fn: ``loss_fn(model, batch)`` returning the loss, or ``(loss, metrics)``;
        ``model`` is in its framework's own form (the NNX module holding the current
        parameters, the Linen module bound to the current variables, the Equinox module) and
        ``batch`` is the global batch. It may also take, by name, ``rng`` (this step's key,
        ``jax.random.fold_in(jax.random.key(seed), step)``: the same on every device and
        strategy), ``train`` (False in :meth:`evaluate`) and ``state`` (the model state, for
        Equinox's ``eqx.nn.State``, in which case it returns ``(loss, metrics, new_state)``).
    :param optimizer: any optax transformation; its state is sharded like the parameters.
    :param strategy: a strategy name (``"dp"``, ``"fsdp"``, ``"2d"``, ``"pmap"`` or an
        installed plugin's) or a :class:`Strategy` from :func:`shardplug.get_strategy`.
    :param devices: how many of the default backend's devices to use (all for None), or the
        devices themselves.
    :param mesh: the mesh's axis sizes, as ``"data=2,model=4"`` or a dict; the strategy's
        default for None.
    :param seed: seeds the parameter initialisation of a model the adapter builds.
    :param log_every: the loop waits for the devices only every ``log_every`` steps (and at
        the end), to read the metrics; ``step_time`` is the mean over that window.
    :param checkpoint_dir: where to keep checkpoints (created if missing; must be writable).
        :meth:`fit` then saves every ``checkpoint_every`` steps and when it ends, in the
        background, each device writing its own shards; SIGINT and SIGTERM finish the
        current step, save it and raise :class:`shardplug.errors.TrainingInterrupted`.
        Continue a run with :meth:`restore`.
    :param checkpoint_every: steps between checkpoints (None: only when ``fit`` ends).
    :param keep: how many checkpoints to keep.
    :param config: JSON-serialisable settings to store in each checkpoint (the command line
        stores its arguments), read back as ``trainer.restored_meta["config"]``.
    :param on_nonfinite: ``"stop"``: a NaN or infinite loss raises
        :class:`shardplug.errors.NonFiniteError` naming the step and the last good
        checkpoint (nothing more is saved; parameters that are not finite are never saved);
        ``"skip"``: a step whose loss or gradient norm is not finite leaves the model and
        optimizer as they were, and is counted in ``trainer.skipped_steps``.
    :param grad_accum: microbatches per step: the step computes the gradient of the batch
        in ``grad_accum`` parts, one after another, inside the compiled step, and makes one
        update, equal to that of the whole batch (batch statistics, being per microbatch,
        excepted). Activation memory falls to that of one microbatch.
    :param precision: ``"float32"``, or ``"bfloat16"`` (``"bf16"``): forward and backward
        in bfloat16 on bfloat16 copies of the parameters and of the batch's float32 leaves;
        parameters, gradients and optimizer state stay float32.
    :param profile_dir: write a profiler trace (TensorBoard, Perfetto) of the steps
        ``profile_steps`` (a ``range`` of step numbers, default 3 to 5, after compilation)
        into this directory (``process_<i>/`` in it for each process of a multi-process run).
    """

    def __init__(
        self,
        adapter: Adapter,
        *,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        strategy: str | Strategy = "dp",
        devices: int | Sequence[Any] | None = None,
        mesh: str | Mapping[str, int] | None = None,
        seed: int = 0,
        log_every: int = 10,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep: int = 3,
        config: Mapping[str, Any] | None = None,
        on_nonfinite: str = "stop",
        grad_accum: int = 1,
        precision: str = "float32",
        profile_dir: str | os.PathLike | None = None,
        profile_steps: range = range(3, 6),
    ):
        if not isinstance(adapter, Adapter):
            raise ConfigError(
                f"Trainer needs a model adapter (shardplug.from_nnx(model)), got "
                f"{type(adapter).__name__}"
            )
        if not callable(loss_fn):
            raise ConfigError("loss_fn must be a function loss_fn(model, batch)")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise ConfigError("optimizer must be an optax GradientTransformation")
        if not isinstance(log_every, int) or log_every < 1:
            raise ConfigError(f"log_every must be a positive integer, got {log_every!r}")
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        if checkpoint_every is not None and (
            not isinstance(checkpoint_every, int)
            or isinstance(checkpoint_every, bool)
            or checkpoint_every < 1
        ):
            raise ConfigError(
                f"checkpoint_every must be a positive integer, got {checkpoint_every!r}"
            )
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs a checkpoint_dir to save into")
        if on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise ConfigError(f"grad_accum must be a positive integer, got {grad_accum!r}")
        _compute_dtype(precision)
        if not isinstance(profile_steps, range) or not profile_steps or profile_steps.step != 1:
            raise ConfigError(
                f"profile_steps must be a non-empty range of steps, got {profile_steps!r}"
            )
        self.grad_accum = grad_accum
        self.precision = precision
        self.profile_dir = None if profile_dir is None else os.fspath(profile_dir)
        self.profile_steps = profile_steps
        try:
            json.dumps(dict(config or {}))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config must be JSON-serialisable: {exc}") from None
        self.config = dict(config or {})
        self.on_nonfinite = on_nonfinite
        self.checkpoint_every = checkpoint_every
        self.checkpoints = None
        if checkpoint_dir is not None:
            from shardplug.checkpoint import Checkpoints

            self.checkpoints = Checkpoints(checkpoint_dir, keep=keep)
        self.restored_meta: dict[str, Any] | None = None
        self.skipped_steps = 0
        self._step = 0  # the host's count of steps taken: the data position
        self._saved_step: int | None = None
        self.adapter = adapter
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.strategy = get_strategy(strategy) if isinstance(strategy, str) else strategy
        self.log_every = log_every
        self.history: list[dict[str, float]] = []
        self.compile_seconds: float | None = None

        if devices is None or isinstance(devices, int):
            devices = select_devices(devices)
        mesh_shape = parse_mesh(mesh) if isinstance(mesh, str) else mesh
        self.mesh = self.strategy.make_mesh(
            list(devices), None if mesh_shape is None else dict(mesh_shape)
        )

        rng = jax.random.key(seed)
        abstract_params, abstract_model_state = adapter.abstract(rng)
        self.annotations = adapter.annotations(abstract_params)
        replicated = NamedSharding(self.mesh, P())
        param_shardings = self.strategy.shard_params(abstract_params, self.mesh, self.annotations)
        self.state_shardings = TrainState(
            step=replicated,
            params=param_shardings,
            opt_state=optimizer_shardings(optimizer, abstract_params, param_shardings, replicated),
            model_state=jax.tree.map(lambda _: replicated, abstract_model_state),
            rng=replicated,
        )
        self.state = self._create_state(rng)
        self._train: _Program | None = None
        self._eval: _Program | None = None

    @property
    def param_shardings(self) -> Any:
        """The ``NamedSharding`` of every parameter, as the strategy chose it."""
        return self.state_shardings.params

    @property
    def compiled(self) -> Any:
        """The compiled step (``jax.stages.Compiled``: ``.as_text()``, ``.memory_analysis()``),
        or None before the first batch."""
        return None if self._train is None else self._train.compiled

    @property
    def batch_shardings(self) -> Any:
        """The ``NamedSharding`` of every batch leaf, or None before the first batch."""
        return None if self._train is None else self._train.batch_shardings

    @property
    def model(self) -> Any:
        """The model with the current parameters, in its framework's own form, in
        evaluation mode (dropout off, batch statistics read from the running averages)."""
        return self.adapter.bind(
            self.state.params, self.state.model_state, rng=step_key(self.state), train=False
        )

    def _create_state(self, rng: jax.Array) -> TrainState:
        shardings = self.state_shardings
        if self.adapter.variables is None:
            # Build every array inside one jit whose outputs are the strategy's shardings:
            # no device ever holds a full copy of a sharded parameter.
            def create(rng):
                params, model_state = self.adapter.init(rng)
                return TrainState(
                    jnp.zeros((), jnp.int32), params, self.optimizer.init(params), model_state, rng
                )

            return jax.jit(create, out_shardings=shardings)(rng)
        # A model that already exists is copied once into the shardings; never aliased,
        # since the step donates its state and the caller's model must stay valid.
        params, model_state = jax.device_put(
            self.adapter.variables, (shardings.params, shardings.model_state), may_alias=False
        )
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step, rng = jax.device_put((jnp.zeros((), jnp.int32), rng), (shardings.step, shardings.rng))
        return TrainState(step, params, opt_state, model_state, rng)

    def _signature(self, batch: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
        leaves, treedef = jax.tree.flatten(batch)
        return treedef, [(np.shape(x), _dtype(x)) for x in leaves]

    def compile(self, batch: Any) -> None:
        """Choose the batch shardings and compile the step for batches shaped like ``batch``.

        ``fit`` does this on its first batch; call it earlier to check a batch against the
        strategy (a batch that does not split raises :class:`BatchError`) or to time the
        compilation apart from training. Later batches must look alike.
        """
        if self._train is not None:
            self._check(batch, 0, self._train.signature)
            return
        start = time.perf_counter()
        self._train = self._build(self._step_for, batch, self.grad_accum)
        self.compile_seconds = time.perf_counter() - start

    def lower(self, batch: Any) -> Any:
        """The training step for batches shaped like ``batch``, lowered but not compiled.

        A ``jax.stages.Lowered``: ``.as_text()`` is the program before partitioning,
        ``.compile()`` the program the devices would run (``.as_text()``, ``.memory_analysis()``).
        """
        return self._lower(self._step_for, batch, self.grad_accum)[0]

    def _step_for(self, batch_shardings: Any) -> Callable:
        return make_step(
            self.adapter,
            self.loss_fn,
            self.optimizer,
            self.strategy,
            self.mesh,
            param_shardings=self.param_shardings,
            batch_shardings=batch_shardings,
            skip_nonfinite=self.on_nonfinite == "skip",
            grad_accum=self.grad_accum,
            precision=self.precision,
        )

    def _lower(
        self, step_for: Callable[[Any], Callable], batch: Any, microbatches: int = 1
    ) -> tuple[Any, Any]:
        """Shard ``batch`` as the strategy says and lower ``step_for(its shardings)``; the
        batch must cut into ``microbatches`` that each split like it."""
        abstract = jax.tree.map(_global_struct, batch)
        batch_shardings = self.strategy.shard_batch(abstract, self.mesh)
        if jax.process_count() > 1:
            jax.tree.map(_check_process_rows, abstract, batch_shardings)
        if microbatches > 1:
            check = functools.partial(_check_microbatches, microbatches)
            jax.tree.map(check, abstract, batch_shardings)
        program = self.strategy.compile_step(
            step_for(batch_shardings), self.mesh, self.state_shardings, batch_shardings
        )
        if not hasattr(program, "lower"):
            raise PluginError(
                f"strategy {self.strategy.name!r}: compile_step must return a jax.jit "
                f"object (something with .lower), got {type(program).__name__}"
            )

        def with_sharding(x, s):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

        lowered = program.lower(
            jax.tree.map(with_sharding, self.state, self.state_shardings),
            jax.tree.map(with_sharding, abstract, batch_shardings),
        )
        return lowered, batch_shardings

    def _build(
        self, step_for: Callable[[Any], Callable], batch: Any, microbatches: int = 1
    ) -> _Program:
        lowered, batch_shardings = self._lower(step_for, batch, microbatches)
        return _Program(lowered.compile(), batch_shardings, self._signature(batch))

    def _check(self, batch: Any, index: int, signature: Any) -> None:
        if self._signature(batch) != signature:
            shapes = [shape for shape, _ in signature[1]]
            raise BatchError(
                f"batch {index} differs from the first batch in structure, shape or dtype "
                f"(first: {shapes}): every batch must look alike"
            )

    def _place(self, batch: Any, index: int) -> Any:
        """Check a training batch against the compiled step's and put it on the devices."""
        self._check(batch, index, self._train.signature)
        return self._put(batch, self._train.batch_shardings)

    @staticmethod
    def _put(batch: Any, shardings: Any) -> Any:
        """This process's rows of the batch as one global array in ``shardings``."""
        if jax.process_count() == 1:
            return jax.device_put(batch, shardings)  # the same, with less bookkeeping
        return jax.tree.map(
            lambda x, s: jax.make_array_from_process_local_data(
                s, np.asarray(x), _global_shape(np.shape(x))
            ),
            batch,
            shardings,
        )

    def evaluate(self, batches: Iterable[Any], steps: int | None = None) -> dict[str, float]:
        """The mean loss and metrics over ``batches``, the model in evaluation mode.

        Nothing is updated: no optimizer step, and batch statistics are read, not written
        (dropout off, BatchNorm on its running averages). ``steps`` bounds how many batches
        are read (needed for an endless iterator). Evaluation batches may differ in shape
        from training batches; they are compiled for once, on the first.
        """
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"steps must be a positive integer or None, got {steps!r}")
        totals: dict[str, jax.Array] | None = None
        count = 0
        for batch in batches if steps is None else itertools.islice(batches, steps):
            if self._eval is None:
                step_fn = make_eval_step(self.adapter, self.loss_fn, self.strategy, self.mesh)
                self._eval = self._build(lambda _, fn=step_fn: fn, batch)
            self._check(batch, count, self._eval.signature)
            self.state, metrics = self._eval.compiled(
                self.state, self._put(batch, self._eval.batch_shardings)
            )
            totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
            count += 1
        if totals is None:
            raise ConfigError("evaluate got no batches")
        return {name: float(value) / count for name, value in jax.device_get(totals).items()}

    @property
    def step(self) -> int:
        """Steps taken so far, counting those of a restored checkpoint: the data position."""
        return self._step

    def fit(
        self,
        batches: Iterable[Any],
        steps: int,
        *,
        callback: Callable[[list[dict[str, float]]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train for ``steps`` steps on ``batches``, continuing from any earlier ``fit``.

        :param batches: an iterable of batches (pytrees of arrays); ``steps`` of them are
            consumed. In a multi-process run each process passes its own block of rows
            (:func:`shardplug.distributed.process_rows`), and the global batch is assembled
            from the processes' blocks. Training stops early, with a warning, if it runs out. After
            :meth:`restore`, pass the batches from :attr:`step` on.
        :param callback: called with the new history rows each time the loop reads metrics.
        :return: this call's history rows: ``step`` (counted across calls and restores, from
            0), ``loss``, the loss function's metrics, ``step_time`` (seconds) and
            ``samples_per_sec`` (and ``skipped``, with ``on_nonfinite="skip"``).
            ``trainer.history`` holds the rows of every call.
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"steps must be a positive integer, got {steps!r}")
        if self.checkpoints is not None and self._saved_step is None:
            existing = self.checkpoints.steps()
            if existing:
                raise CheckpointError(
                    f"{self.checkpoints.directory} already holds checkpoints (newest: step "
                    f"{existing[-1]}): call restore() to continue that run, or choose an "
                    f"empty directory"
                )
        iterator = iter(batches)
        if self._train is None:  # compile on the first batch, in this thread
            first = next(iterator, None)
            if first is None:
                warnings.warn(f"batches ran out after 0 of {steps} steps", stacklevel=2)
                return []
            self.compile(first)
            iterator = itertools.chain([first], iterator)
        rows: list[dict[str, float]] = []
        pending: list[dict[str, jax.Array]] = []
        started = time.perf_counter()

        def flush() -> None:
            nonlocal started
            new = self._rows(pending, self._step - len(pending), started)
            pending.clear()
            faults = [
                row.pop(NONFINITE) > 0 if NONFINITE in row else not math.isfinite(row["loss"])
                for row in new
            ]
            if self.on_nonfinite == "skip":
                for row, fault in zip(new, faults, strict=True):
                    row["skipped"] = float(fault)
                self.skipped_steps += sum(faults)
            elif True in faults:
                new = new[: faults.index(True) + 1]  # nothing after the fault
            rows.extend(new)
            self.history.extend(new)
            if callback is not None:
                callback(new)
            if self.on_nonfinite == "stop" and True in faults:
                raise self._nonfinite(int(new[-1]["step"]))
            started = time.perf_counter()

        program = self._train
        first_step = self._step
        feed = _Prefetch(iterator, steps, lambda batch, i: self._place(batch, first_step + i))
        trace = _Trace(self.profile_dir, self.profile_steps)
        in_flight: collections.deque = collections.deque()
        with _StopSignals(enabled=self.checkpoints is not None) as stop:
            try:
                for i in range(steps):
                    if stop.requested:
                        break
                    try:
                        global_batch = next(feed)
                    except StopIteration:
                        warnings.warn(f"batches ran out after {i} of {steps} steps", stacklevel=2)
                        break
                    if len(in_flight) == MAX_IN_FLIGHT:  # a step long done: no stall
                        jax.block_until_ready(in_flight.popleft())
                    with trace.step(self._step, lambda: self.state):
                        self.state, metrics = program.compiled(self.state, global_batch)
                    self._step += 1
                    pending.append(metrics)
                    in_flight.append(metrics["loss"])
                    due = self.checkpoint_every is not None and (
                        self._step % self.checkpoint_every == 0
                    )
                    if len(pending) == self.log_every or due:
                        flush()
                        stop.agree()  # at the same step in every process
                    if due:
                        self.save()
                        started = time.perf_counter()  # saving is not a step
                if pending:
                    flush()
                stop.agree()
                if self.checkpoints is not None and self._saved_step != self._step:
                    self.save()
            finally:
                feed.close()
                trace.close(self.state)
                if self.checkpoints is not None:
                    self.checkpoints.wait()
        if stop.requested:
            name = signal.Signals(stop.requested).name
            path = self.last_checkpoint
            raise TrainingInterrupted(
                f"stopped by {name} after step {self._step}; saved {path}: continue with "
                f"restore() (--resume)",
                signal=stop.requested,
                step=self._step,
                checkpoint=path,
            )
        return rows

    def save(self) -> str:
        """Checkpoint the current state now (in the background); returns its path."""
        if self.checkpoints is None:
            raise ConfigError("this Trainer has no checkpoint_dir to save into")
        if not bool(_finite(self.state.params)):  # never save a broken model
            raise self._nonfinite(self._step - 1, what="the parameters are")
        from shardplug import __version__

        meta = {
            "data_position": self._step,
            "skipped_steps": self.skipped_steps,
            "strategy": self.strategy.name,
            "addons": list(self.strategy.addons),
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "devices": int(self.mesh.size),
            "shardplug": __version__,
            "config": self.config,
        }
        path = self.checkpoints.save(self._step, self.state, meta)
        self._saved_step = self._step
        return str(path)

    def restore(self, step: int | None = None) -> int:
        """Continue from the newest good checkpoint in ``checkpoint_dir`` (or from ``step``).

        The arrays are read straight into this trainer's shardings: the strategy, device count
        and mesh may differ from the run that saved them. A damaged checkpoint is reported
        (a :class:`ShardplugWarning` with its path), moved aside to ``<step>.damaged``, and
        the one before it is used. :class:`shardplug.errors.CheckpointError` when there is
        none, or when it is of another model or optimizer (naming the arrays that differ).

        :return: the step restored, which is also :attr:`step`, the data position.
        """
        if self.checkpoints is None:
            raise ConfigError("this Trainer has no checkpoint_dir to restore from")
        self.checkpoints.wait()
        state, meta = self.checkpoints.restore(
            self.state, self.state_shardings, step=step, quarantine=True
        )
        self.state = state
        self._step = int(meta["data_position"])
        self._saved_step = int(meta["step"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.restored_meta = meta
        return self._step

    @property
    def last_checkpoint(self) -> str | None:
        """The path of the newest checkpoint saved or restored by this trainer, if any."""
        if self.checkpoints is None or self._saved_step is None:
            return None
        return str(self.checkpoints.path(self._saved_step))

    def _nonfinite(self, step: int, what: str = "the loss is") -> NonFiniteError:
        path = self.last_checkpoint
        last = f"last good checkpoint: {path}" if path else "no checkpoint saved"
        return NonFiniteError(
            f"{what} not finite (NaN or inf) at step {step}; {last}. "
            f"Lower the learning rate, or skip such steps with on_nonfinite='skip' "
            f"(--on-nonfinite skip)",
            step=step,
            checkpoint=path,
        )

    def _rows(
        self, pending: list[dict[str, jax.Array]], first: int, started: float
    ) -> list[dict[str, float]]:
        values = jax.device_get(pending)  # the loop's only wait on the devices
        step_time = (time.perf_counter() - started) / len(values)
        samples = _batch_rows(self._train.signature) * jax.process_count()
        rows = []
        for k, metrics in enumerate(values):
            row = {"step": first + k, **{name: float(v) for name, v in metrics.items()}}
            row["step_time"] = step_time
            row["samples_per_sec"] = samples / step_time if step_time > 0 else math.inf
            rows.append(row)
        return rows


class _Prefetch:
    """Reads up to ``count`` batches and puts them on the devices in a background thread,
    ``depth`` ahead of the loop: the next batch is on its way while a step runs, and ready
    when the loop comes back from reading the metrics. Errors reach the loop in order."""

    _END = object()

    def __init__(self, batches: Iterable[Any], count: int, place: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(iter(batches), count, place), daemon=True
        )
        self._thread.start()

    def _run(self, batches: Any, count: int, place: Callable) -> None:
        try:
            for i in range(count):
                batch = next(batches, self._END)
                if batch is self._END:
                    break
                if not self._offer(place(batch, i)):
                    return
        except BaseException as exc:  # handed to the loop, raised there
            self._offer(_Failure(exc))
            return
        self._offer(self._END)

    def _offer(self, item: Any) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # stays ended
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)


class _Failure(NamedTuple):
    error: BaseException


class _Trace:
    """A profiler trace of the steps in ``steps`` (TensorBoard and Perfetto), when asked."""

    def __init__(self, directory: str | None, steps: range):
        self.directory, self.steps, self.active = directory, steps, False

    @contextlib.contextmanager
    def step(self, number: int, state: Callable[[], Any]) -> Any:
        if self.directory is not None and number == self.steps.start:
            jax.block_until_ready(state())  # the trace holds these steps only
            directory = self.directory
            if jax.process_count() > 1:  # one trace per process, not one file fought over
                directory = os.path.join(directory, f"process_{jax.process_index()}")
            jax.profiler.start_trace(directory, create_perfetto_trace=True)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            yield
        if number + 1 == self.steps.stop:
            self.close(state())

    def close(self, state: Any) -> None:
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False


class _StopSignals:
    """While active (in the main thread), SIGINT and SIGTERM ask the loop to stop after the
    current step instead of killing it; a second SIGINT interrupts at once.

    In a multi-process run every process must stop after the same step (a process that ran
    one more step would wait forever in its collectives for the others, who are saving), so
    a signal only takes effect once the processes agree on it, at :meth:`agree`: the loop
    calls it where it reads the metrics, at the same step in every process.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._agreed: int | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> int | None:
        """The signal to stop for: as received (one process), or as agreed (many)."""
        return self._agreed if self._multi else self.received

    def agree(self) -> None:
        """Share the signals received so far; every process must call it at the same step."""
        if not (self._multi and self.enabled):
            return
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received or 0))
        received = [int(f) for f in np.ravel(flags) if f]
        self._agreed = received[0] if received else None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> _StopSignals:
        if self.enabled:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@jax.jit
def _finite(tree: Any) -> jax.Array:
    return jnp.isfinite(optax.tree.norm(tree))


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _global_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the global batch leaf a process's leaf of ``shape`` is part of: in a
    multi-process run each process holds an equal block of the leading (batch) dimension."""
    if shape and jax.process_count() > 1:
        return (shape[0] * jax.process_count(), *shape[1:])
    return tuple(shape)


def _global_struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_global_shape(np.shape(x)), _dtype(x))


def _check_process_rows(leaf: jax.ShapeDtypeStruct, sharding: NamedSharding) -> None:
    """The strategy must give this process exactly the rows it feeds."""
    if not leaf.shape:
        return
    from shardplug.distributed import process_rows

    want = process_rows(leaf.shape[0])
    rows = {
        index[0].indices(leaf.shape[0])[:2]
        for index in sharding.addressable_devices_indices_map(leaf.shape).values()
    }
    lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
    if (lo, hi) != (want.start, want.stop):
        raise BatchError(
            f"the strategy's batch sharding {sharding.spec} gives process "
            f"{jax.process_index()} rows {lo}..{hi - 1} of {leaf.shape[0]}, but each process "
            f"feeds its own block ({want.start}..{want.stop - 1}): split the batch over "
            f"axes whose devices are grouped by process"
        )


def _check_microbatches(k: int, leaf: jax.ShapeDtypeStruct, sharding: NamedSharding) -> None:
    """Each of the ``k`` microbatches must split over the devices as the batch does."""
    if not leaf.shape:
        return
    parts = math.prod(sharding.mesh.shape[a] for a in leading_axes(sharding.spec))
    if leaf.shape[0] % (k * parts):
        raise BatchError(
            f"a batch of {leaf.shape[0]} rows does not cut into {k} microbatches that each "
            f"split over {parts} devices: use a global batch size that is a multiple of "
            f"{k * parts} (grad_accum x devices)"
        )


def _batch_rows(signature: Any) -> int:
    """The global batch size: the leading dimension of the first leaf that has one."""
    shapes = [shape for shape, _ in signature[1] if shape]
    return int(shapes[0][0]) if shapes else 1


__all__ = ["TrainState", "Trainer", "make_step"]
