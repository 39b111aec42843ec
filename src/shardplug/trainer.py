"""The trainer: a small facade over a validated configuration, the traced step and the loop."""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import optax

from shardplug.core.devices import select_devices
from shardplug.core.mesh import (
    explain_axis_types,
    explicit_need,
    model_axes_error,
    parse_mesh,
    retyped,
)
from shardplug.core.registry import Strategy, get_strategy
from shardplug.core.state import create_state, state_shardings
from shardplug.core.step import (
    LossFn,
    Precision,
    TrainState,
    _finite,
    make_eval_step,
    make_step,
    step_key,
)
from shardplug.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    ShardplugWarning,
)
from shardplug.flops import warn_if_float32
from shardplug.loop import feed, program
from shardplug.loop.evaluate import check_eval, evaluate
from shardplug.loop.position import SKIP, Tracked, stateful
from shardplug.loop.program import Program, RunState
from shardplug.loop.run import run
from shardplug.models.adapter import Adapter
from shardplug.settings import AxisTypes, OnNonFinite, Settings


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
        default for None (a composition sizes the axes left out).
    :param axis_names: renames a composition's mesh axes to the names the model uses, e.g.
        ``{"model": "tp"}`` for a model whose partition specs say ``"tp"``.
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
    :param precision: ``"float32"``, or ``"bfloat16"`` (``"bf16"``): the matrix products of
        forward and backward in bfloat16, on bfloat16 copies of the parameters and the batch's
        float32 leaves, stock layers that chose no dtype computing in it; parameters,
        gradients and optimizer state stay float32. Products left in float32 are warned of.
    :param profile_dir: write a profiler trace (TensorBoard, Perfetto) of the steps
        ``profile_steps`` (a ``range`` of step numbers, default 3 to 5, after compilation)
        into this directory (``process_<i>/`` in it for each process of a multi-process run).
    :param axis_types: the mesh's axis types: ``"auto"`` (JAX's ``AxisType.Auto``: the
        compiler propagates shardings), ``"explicit"`` (``AxisType.Explicit``: shardings are
        part of every array's type, for models that use ``jax.sharding.reshard``, einsums with
        ``out_sharding`` and the like), or None: explicit when the model's parameters already
        live on an explicit mesh or its code needs explicit axes (found when the step is
        first traced), auto otherwise; ``trainer.axis_types`` and ``axis_types_reason`` say
        which ran and why.
    :param allocate: False plans without allocating: the state is only shapes and shardings
        (``jax.ShapeDtypeStruct``), so the step can be compiled and explained
        (:func:`shardplug.explain.explain`) for a model larger than this machine's memory,
        but not run.
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
        axis_names: Mapping[str, str] | None = None,
        seed: int = 0,
        log_every: int = 10,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep: int = 3,
        config: Mapping[str, Any] | None = None,
        on_nonfinite: OnNonFinite = "stop",
        grad_accum: int = 1,
        precision: Precision = "float32",
        profile_dir: str | os.PathLike | None = None,
        profile_steps: range = range(3, 6),
        allocate: bool = True,
        axis_types: AxisTypes | None = None,
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
        self.settings = settings = Settings(
            seed=seed, log_every=log_every, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, keep=keep, config=config or {},
            on_nonfinite=on_nonfinite, grad_accum=grad_accum, precision=precision,
            profile_dir=profile_dir, profile_steps=profile_steps, axis_types=axis_types,
        )  # fmt: skip
        self.grad_accum, self.precision = settings.grad_accum, settings.precision
        self.profile_dir, self.profile_steps = settings.profile_dir, settings.profile_steps
        self.config, self.on_nonfinite = settings.config, settings.on_nonfinite
        self.checkpoint_every, self.log_every = settings.checkpoint_every, settings.log_every
        self.checkpoints = None
        if settings.checkpoint_dir is not None:
            from shardplug.checkpoint import Checkpoints

            self.checkpoints = Checkpoints(settings.checkpoint_dir, keep=settings.keep)
        self.restored_meta: dict[str, Any] | None = None
        self.skipped_steps = 0
        self.adapter = adapter
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        if isinstance(strategy, str):
            strategy = get_strategy(strategy, axis_names=axis_names)
        elif axis_names:
            raise ConfigError(
                "axis_names goes with a strategy name; for a Strategy object pass it to "
                "get_strategy(name, axis_names=...)"
            )
        self.strategy = strategy
        self.history: list[dict[str, float]] = []
        self.compile_seconds: float | None = None
        #: textbook FLOPs per sample (shardplug.flops, for model_tflops and mfu), peak TFLOP/s
        #: of unknown devices, seconds to wait for a batch (None: announced, never given up)
        self.flops_per_sample: float | None = None
        self.peak_tflops: float | None = None
        self.data_timeout: float | None = None
        self._data: Any = None  # the data's position (loop.position.Tracked), when it has one
        self._data_state: Any = None  # a restored checkpoint's data state, not yet applied

        if devices is None or isinstance(devices, int):
            devices = select_devices(devices)
        mesh_shape = parse_mesh(mesh) if isinstance(mesh, str) else mesh
        #: the mesh's axis types ("auto" or "explicit") and why they were chosen
        self.axis_types, self.axis_types_reason = explain_axis_types(axis_types, adapter)
        self.mesh = self.strategy.make_mesh(
            list(devices), None if mesh_shape is None else dict(mesh_shape), self.axis_types
        )

        rng = jax.random.key(seed)
        self.allocated = allocate
        self._abstract = self._explicit_if_needed(lambda: adapter.abstract(rng), build=True)
        self.annotations = self._explicit_if_needed(
            lambda: adapter.annotations(self._abstract[0]), build=True
        )
        self._lay_out()
        self.state = self._explicit_if_needed(
            lambda: create_state(adapter, optimizer, self.state_shardings, rng, allocate=allocate),
            build=True,
        )
        self._train: Program | None = None
        self._eval: Program | None = None

    def _explicit_if_needed(self, fn: Callable[[], Any], *, build: bool = False) -> Any:
        """``fn()``; when the mode was left to choose and the model's code turns out to need
        explicit mesh axes, again on them. A model is built (``build``) under the run's mesh
        on explicit axes: it may reshard in its forward pass (no activation rules there: a
        sample input's rows need not split). On auto axes it is built outside any mesh: a
        Flax model's partition metadata names logical axes only the strategy maps."""

        def call() -> Any:
            if build and self.axis_types == "explicit":
                with jax.set_mesh(self.mesh):
                    return fn()
            return fn()

        try:
            return self._refusing(call)
        except Exception as exc:
            need = explicit_need(exc, self.settings.axis_types)
            if need is None:
                raise
        self.strategy.check_explicit()  # the run's mesh, the same devices and layouts
        self.axis_types = "explicit"
        self.axis_types_reason = f"the model's code needs explicit axes ({need})"
        self.mesh = retyped(self.mesh, "explicit")
        if hasattr(self, "state_shardings"):
            self._lay_out()
        if hasattr(self, "_run"):
            self.state = jax.tree.map(
                lambda x, s: jax.device_put(x, s) if self.allocated
                else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                self.state, self.state_shardings,
            )  # fmt: skip
        return self._refusing(call)

    def _refusing(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, a model whose code names mesh axes the run cannot give it refused in one
        line (:func:`shardplug.core.mesh.model_axes_error`)."""
        try:
            return fn()
        except Exception as exc:
            composition = self.strategy.composition
            batch_axes = composition.batch_axes if composition is not None else ()
            refused = model_axes_error(exc, self.mesh, batch_axes)
            if refused is not None:
                raise refused from exc
            raise

    def _lay_out(self) -> None:
        """The state's shardings on the run's mesh, as the strategy chooses them."""
        self.state_shardings = state_shardings(
            self.strategy, self.mesh, self.optimizer, *self._abstract, self.annotations
        )

    @property
    def state(self) -> TrainState:
        """The training state, global arrays in their shardings (rebuilt from the flat list
        of arrays the compiled step reads and writes; PRNG keys held as their key data)."""
        if not self.allocated:
            return self._planned
        return self._run.state()

    @state.setter
    def state(self, state: TrainState) -> None:
        self._planned = None if self.allocated else state
        self._run = RunState.of(state, getattr(self, "_run", None))

    @property
    def param_shardings(self) -> Any:
        """The ``NamedSharding`` of every parameter, as the strategy chose it."""
        return self.state_shardings.params

    @property
    def program(self) -> Program | None:
        """The compiled training step as a value (``compiled``, ``batch_shardings``,
        ``signature``, ``jaxpr``), or None before the first batch."""
        return self._train

    @property
    def compiled(self) -> Any:
        """The compiled step (``jax.stages.Compiled``: ``.as_text()``, ``.memory_analysis()``),
        or None before the first batch."""
        return None if self._train is None else self._train.compiled

    @property
    def jaxpr(self) -> Any:
        """The traced training step (``jax.extend.core.ClosedJaxpr``), None before compiling."""
        return None if self._train is None else self._train.jaxpr

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

    def compile(self, batch: Any) -> None:
        """Choose the batch shardings and compile the step for batches shaped like ``batch``.

        ``fit`` does this on its first batch; call it earlier to check a batch against the
        strategy (a batch that does not split raises :class:`BatchError`) or to time the
        compilation apart from training. Later batches must look alike.
        """
        if self._train is not None:
            feed.check(batch, 0, self._train.signature)
            return
        feed.check_resumed(batch, self.restored_meta)  # the data position counts batches
        start = time.perf_counter()
        self._train = self._build(self._step_for, batch, self.grad_accum)
        self.compile_seconds = time.perf_counter() - start
        warn_if_float32(self._train.jaxpr, self.precision)

    def lower(self, batch: Any) -> Any:
        """The training step for batches shaped like ``batch``, lowered but not compiled.

        A ``jax.stages.Lowered``: ``.as_text()`` is the program before partitioning,
        ``.compile()`` the program the devices would run (``.as_text()``, ``.memory_analysis()``).
        """
        return self._explicit_if_needed(
            lambda: program.lower(self._step_for, batch, **self._context(self.grad_accum))
        )[0]

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

    def _context(self, microbatches: int = 1) -> dict[str, Any]:
        return dict(strategy=self.strategy, mesh=self.mesh, state_shardings=self.state_shardings,
                    run=self._run, microbatches=microbatches)  # fmt: skip

    def _build(self, step_for: Callable[[Any], Callable], batch: Any, microbatches: int = 1):
        return self._explicit_if_needed(
            lambda: program.build(step_for, batch, **self._context(microbatches))
        )

    def _eval_program(self, batch: Any) -> Program:
        """The evaluation step, compiled once, on the first evaluation batch."""
        if self._eval is None:
            fn = make_eval_step(self.adapter, self.loss_fn, self.strategy, self.mesh)
            self._eval = self._build(lambda _: fn, batch)
        return self._eval

    def evaluate(self, batches: Iterable[Any], steps: int | None = None) -> dict[str, float]:
        """The mean loss and metrics over ``batches``, the model in evaluation mode.

        Nothing is updated: no optimizer step, and batch statistics are read, not written
        (dropout off, BatchNorm on its running averages). ``steps`` bounds how many batches
        are read; without it a source with no length is read to at most
        :data:`~shardplug.loop.evaluate.EVAL_CAP` batches (an endless one would never end),
        and the result's ``batches`` says so when the cap stopped it. Evaluation batches
        may differ in shape from training batches; they are compiled for once, on the first.
        """
        if not self.allocated:
            raise ConfigError(
                "this Trainer plans (allocate=False): it compiles, it does not evaluate"
            )
        return evaluate(self._run, self._eval_program, batches, steps)

    @property
    def step(self) -> int:
        """Steps taken so far, counting those of a restored checkpoint: the data position."""
        return self._run.step

    def fit(
        self,
        batches: Iterable[Any],
        steps: int,
        *,
        callback: Callable[[list[dict[str, float]]], None] | None = None,
        eval_data: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
        eval_every: int | None = None,
        eval_steps: int | None = None,
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
        if self.checkpoints is not None and self._run.saved_step is None:
            existing = self.checkpoints.steps()
            if existing:
                raise CheckpointError(
                    f"{self.checkpoints.directory} already holds checkpoints (newest: step "
                    f"{existing[-1]}): call restore() to continue that run, or choose an "
                    f"empty directory"
                )
        if not self.allocated:
            raise ConfigError("this Trainer plans (allocate=False): it compiles, it does not train")
        check_eval(eval_data, eval_every)
        iterator = iter(batches)
        if stateful(iterator):  # Grain's: its state goes into every checkpoint
            iterator = self._data = Tracked.resumed(iterator, self.step, self._data_state)
            self._data_state = None
        evaluate = None
        if eval_every is not None:

            def read() -> dict[str, float]:
                held_out = eval_data() if callable(eval_data) else eval_data
                return self.evaluate(held_out, steps=eval_steps)

            evaluate = (eval_every, read)
        if self._train is None:  # compile on the first batch, in this thread
            first = next(iterator, None)
            if first is None:
                warnings.warn(f"batches ran out after 0 of {steps} steps", ShardplugWarning, 2)
                return []
            self.compile(first)
            iterator = itertools.chain([first], iterator)
        return run(self, self._run, self._train, iterator, steps, callback, evaluate)

    def save(self) -> str:
        """Checkpoint the current state now (in the background); returns its path."""
        if self.checkpoints is None:
            raise ConfigError("this Trainer has no checkpoint_dir to save into")
        if not bool(_finite(self.state.params)):  # never save a broken model
            raise NonFiniteError.at(self.step - 1, self.last_checkpoint, "the parameters are")
        from shardplug import __version__

        meta = {
            "data_position": self.step,
            "skipped_steps": self.skipped_steps,
            "strategy": self.strategy.name,
            "addons": list(self.strategy.addons),
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "devices": int(self.mesh.size),
            "shardplug": __version__,
            "config": self.config,
            "batch_shapes": feed.global_shapes(self._train.signature) if self._train else None,
        }
        if self._data is not None:  # where the next batch starts
            meta["data_state"] = self._data.state_at(self.step)
        path = self.checkpoints.save(self.step, self.state, meta)
        self._run.saved_step = self.step
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
        self._run.step, self._run.saved_step = int(meta["data_position"]), int(meta["step"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.restored_meta = meta
        self._data_state = meta.get("data_state", SKIP)  # older checkpoints: skip to the step
        return self.step

    @property
    def last_checkpoint(self) -> str | None:
        """The path of the newest checkpoint saved or restored by this trainer, if any."""
        if self.checkpoints is None or self._run.saved_step is None:
            return None
        return str(self.checkpoints.path(self._run.saved_step))


__all__ = ["TrainState", "Trainer", "make_step"]
