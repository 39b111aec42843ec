"""The trainer: owns the loop, asks the strategy where things live and how devices meet."""

from __future__ import annotations

import inspect
import itertools
import math
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

from shardplug.core.devices import select_devices
from shardplug.core.mesh import parse_mesh
from shardplug.core.registry import Strategy, get_strategy
from shardplug.core.sharding import optimizer_shardings
from shardplug.errors import BatchError, ConfigError, PluginError
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


def make_step(
    adapter: Adapter,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    strategy: Strategy,
    mesh: Any,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """One optimizer step on the global batch: loss, gradients, ``reduce_grads``, update."""
    extras = loss_extras(loss_fn)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        rng = step_key(state)

        # The model state is an argument, not a closure: frameworks that update it in place
        # (NNX's BatchStat) must see it at the level of the gradient's trace.
        def loss_of(params, model_state):
            params = strategy.gather_params(params, mesh)
            return _forward(adapter, loss_fn, extras, params, model_state, rng, batch, True)

        (loss, (metrics, model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            state.params, state.model_state
        )
        grads = strategy.reduce_grads(grads, mesh)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(state.step + 1, params, opt_state, model_state, state.rng)
        return new, {"loss": loss, **metrics}

    return step


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
        self._train = self._build(
            make_step(self.adapter, self.loss_fn, self.optimizer, self.strategy, self.mesh), batch
        )
        self.compile_seconds = time.perf_counter() - start

    def _build(self, step_fn: Callable, batch: Any) -> _Program:
        """Shard ``batch`` as the strategy says and compile ``step_fn`` for it."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), batch)
        batch_shardings = self.strategy.shard_batch(abstract, self.mesh)
        program = self.strategy.compile_step(
            step_fn, self.mesh, self.state_shardings, batch_shardings
        )
        if not hasattr(program, "lower"):
            raise PluginError(
                f"strategy {self.strategy.name!r}: compile_step must return a jax.jit "
                f"object (something with .lower), got {type(program).__name__}"
            )

        def with_sharding(x, s):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

        compiled = program.lower(
            jax.tree.map(with_sharding, self.state, self.state_shardings),
            jax.tree.map(with_sharding, abstract, batch_shardings),
        ).compile()
        return _Program(compiled, batch_shardings, self._signature(batch))

    def _check(self, batch: Any, index: int, signature: Any) -> None:
        if self._signature(batch) != signature:
            shapes = [shape for shape, _ in signature[1]]
            raise BatchError(
                f"batch {index} differs from the first batch in structure, shape or dtype "
                f"(first: {shapes}): every batch must look alike"
            )

    @staticmethod
    def _put(batch: Any, shardings: Any) -> Any:
        """The host batch as a global array in ``shardings``."""
        return jax.tree.map(
            lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
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
                self._eval = self._build(step_fn, batch)
            self._check(batch, count, self._eval.signature)
            self.state, metrics = self._eval.compiled(
                self.state, self._put(batch, self._eval.batch_shardings)
            )
            totals = metrics if totals is None else jax.tree.map(jnp.add, totals, metrics)
            count += 1
        if totals is None:
            raise ConfigError("evaluate got no batches")
        return {name: float(value) / count for name, value in jax.device_get(totals).items()}

    def fit(
        self,
        batches: Iterable[Any],
        steps: int,
        *,
        callback: Callable[[list[dict[str, float]]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train for ``steps`` steps on ``batches``, continuing from any earlier ``fit``.

        :param batches: an iterable of global batches (pytrees of arrays); ``steps`` of them
            are consumed. Training stops early, with a warning, if it runs out.
        :param callback: called with the new history rows each time the loop reads metrics.
        :return: this call's history rows: ``step`` (counted across calls, from 0), ``loss``,
            the loss function's metrics, ``step_time`` (seconds) and ``samples_per_sec``.
            ``trainer.history`` holds the rows of every call.
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"steps must be a positive integer, got {steps!r}")
        iterator = iter(batches)
        first_step = len(self.history)
        rows: list[dict[str, float]] = []
        pending: list[dict[str, jax.Array]] = []

        def flush() -> None:
            new = self._rows(pending, first_step + len(rows), started)
            rows.extend(new)
            self.history.extend(new)
            pending.clear()
            if callback is not None:
                callback(new)

        started = time.perf_counter()
        for i in range(steps):
            try:
                batch = next(iterator)
            except StopIteration:
                warnings.warn(f"batches ran out after {i} of {steps} steps", stacklevel=2)
                break
            if self._train is None:
                self.compile(batch)
                started = time.perf_counter()  # compilation is not a step
            else:
                self._check(batch, first_step + i, self._train.signature)
            global_batch = self._put(batch, self._train.batch_shardings)
            self.state, metrics = self._train.compiled(self.state, global_batch)
            pending.append(metrics)
            if len(pending) == self.log_every:
                flush()
                started = time.perf_counter()
        if pending:
            flush()
        return rows

    def _rows(
        self, pending: list[dict[str, jax.Array]], first: int, started: float
    ) -> list[dict[str, float]]:
        values = jax.device_get(pending)  # the loop's only wait on the devices
        step_time = (time.perf_counter() - started) / len(values)
        samples = _batch_rows(self._train.signature)
        return [
            {
                "step": first + k,
                **{name: float(v) for name, v in metrics.items()},
                "step_time": step_time,
                "samples_per_sec": samples / step_time if step_time > 0 else math.inf,
            }
            for k, metrics in enumerate(values)
        ]


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _batch_rows(signature: Any) -> int:
    """The global batch size: the leading dimension of the first leaf that has one."""
    shapes = [shape for shape, _ in signature[1] if shape]
    return int(shapes[0][0]) if shapes else 1


__all__ = ["TrainState", "Trainer", "make_step"]
