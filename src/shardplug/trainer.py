"""The trainer: a facade. Its arguments become :class:`~shardplug.settings.Settings`, where
arrays live a :class:`~shardplug.layout.Layout` (decided once), the step a compiled
:class:`~shardplug.loop.program.Program`; ``fit`` hands those, the state and the checkpoints
to the loop (:func:`shardplug.loop.run.run`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import optax

from shardplug.core.flops import warn_if_float32
from shardplug.core.precision import auto_precision
from shardplug.core.registry import Strategy, resolve_strategy
from shardplug.core.state import create_state
from shardplug.core.step import LossFn, TrainState, step_key
from shardplug.errors import ConfigError
from shardplug.layout import Layout
from shardplug.loop import feed
from shardplug.loop import program as programs
from shardplug.loop.evaluate import evaluate, periodic
from shardplug.loop.position import SKIP, Tracked, stateful
from shardplug.loop.program import Program, RunState
from shardplug.loop.run import compiled_on_first, run, say_devices
from shardplug.loop.saving import RunCheckpoints, run_meta
from shardplug.models.adapter import Adapter, check_parts
from shardplug.settings import Settings, reads


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
        installed plugin's) or a :class:`Strategy` from :func:`shardplug.get_strategy`;
        None (the default): the plainest installed, data parallelism
        (:func:`shardplug.core.registry.plain_strategy`).
    :param devices: how many of the default backend's devices to use (all for None), or the
        devices themselves; ``mesh``: the axis sizes, ``"data=2,model=4"`` or a dict (None:
        the strategy's; a composition sizes the axes left out); ``axis_names``: a
        composition's axes renamed as the model names them, e.g. ``{"model": "tp"}``.
    :param allocate: False plans without allocating: the state is only shapes and shardings
        (``jax.ShapeDtypeStruct``), so the step can be compiled and explained
        (:func:`shardplug.planning.explain.explain`) for a model larger than this machine's memory.
    :param precision: ``"auto"`` (the default): ``"bf16"`` where the devices have bfloat16
        matrix units (a TPU, an NVIDIA GPU from the A100 on), ``"float32"`` elsewhere;
        ``trainer.precision`` and ``trainer.precision_reason`` say which and why.

    The other keyword arguments say how the run goes (``seed``, ``precision``,
    ``checkpoint_dir``, ...): they are its :class:`~shardplug.settings.Settings`, validated
    once and documented there; or give ``settings=`` a ``Settings`` (its fields as keywords
    beside it replace its own).
    """

    def __init__(
        self, adapter: Adapter, *, loss_fn: LossFn, optimizer: optax.GradientTransformation,
        strategy: str | Strategy | None = None, devices: int | Sequence[Any] | None = None,
        mesh: str | Mapping[str, int] | None = None,
        axis_names: Mapping[str, str] | None = None, allocate: bool = True,
        settings: Settings | None = None, **how: Any,
    ):  # fmt: skip
        check_parts(adapter, loss_fn, optimizer, ConfigError, "Trainer")
        chosen = jax.devices()[0] if not isinstance(devices, Sequence) else devices[0]
        settings = Settings.of(settings, how)
        precision, self.precision_reason = auto_precision(chosen, settings.precision)
        self.settings = settings = dataclasses.replace(settings, precision=precision)
        seed, axis_types = settings.seed, settings.axis_types
        self._saver = RunCheckpoints.at(self.settings, lambda run: run_meta(
            self.strategy, self.mesh, self.config, self._train, self._data, run),
            adapter)  # fmt: skip
        self.checkpoints = self._saver and self._saver.store
        self.restored_meta: dict[str, Any] | None = None
        self.adapter, self.loss_fn, self.optimizer = adapter, loss_fn, optimizer
        self.strategy = strategy = resolve_strategy(strategy, axis_names)
        self.compile_seconds: float | None = None
        # the data's position (loop.position.Tracked); a restored data state not yet applied
        self._data = self._data_state = None
        rng = jax.random.key(seed)
        self.layout = Layout.decide(strategy, adapter, optimizer, devices=devices, mesh=mesh,
                                    axis_types=axis_types, rng=rng)  # fmt: skip
        self.allocated = allocate
        self.state = self._on_layout(lambda: create_state(adapter, optimizer,
            self.state_shardings, rng, allocate=allocate), build=True)  # fmt: skip
        self._train = self._eval = None  # the training and evaluation Programs, once built
        self._loss_normalised = False  # the loss divides by a count of the batch (compile)
        #: each parameter's :class:`shardplug.plugin.Role` by path, read from the traced loss
        self.roles: Any = None  # (None before compiling, or where the loss traces not alone)
        self._said = False  # the run's first line, said by the first fit

    def allocate(self) -> None:
        """Create the state a planning trainer (``allocate=False``) only described, in the
        same shardings, keeping any step it compiled: plan, check the plan, then train."""
        if self.allocated:
            return
        state = self._on_layout(lambda: create_state(self.adapter, self.optimizer,
            self.state_shardings, jax.random.key(self.settings.seed), allocate=True))  # fmt: skip
        self.allocated, self.state = True, state  # in this order: the setter reads allocated

    def _on_layout(self, fn: Callable[[], Any], *, build: bool = False) -> Any:
        """``fn()`` on the run's layout; when the model's code turns out to need explicit mesh
        axes, the layout moves onto them and the state with it (:meth:`Layout.attempt`)."""
        return self.layout.attempt(fn, build=build, moving=self._move)[0]

    def _move(self, layout: Layout) -> None:
        self.layout = layout
        if hasattr(self, "_run"):
            self.state = layout.place(self.state, self.allocated)

    # The layout's, the settings' and the run's figures, under the names users read them by.
    mesh = reads("layout", "mesh", "The run's ``jax.sharding.Mesh``.")
    axis_types = reads("layout", "axis_types", 'The mesh\'s axis types: "auto" or "explicit".')
    axis_types_reason = reads("layout", "axis_types_reason", "Why the axis types were chosen.")
    annotations = reads("layout", "annotations", "The model's annotations, as the strategy saw.")
    state_shardings = reads("layout", "shardings", "A ``NamedSharding`` per leaf of the state.")
    grad_accum = reads("settings", "grad_accum")
    precision = reads("settings", "precision")
    config = reads("settings", "config")
    data_timeout = reads("settings", "data_timeout", "Seconds to wait for a batch.")
    flops_per_sample = reads("settings", "flops_per_sample", "FLOPs per sample (MFU).")
    peak_tflops = reads("settings", "peak_tflops", "Peak TFLOP/s of an unknown device.")
    history = reads("_run", "history", "The rows of every ``fit``.")
    skipped_steps = reads("_run", "skipped", "Steps skipped for a non-finite loss or gradient.")
    step = reads("_run", "step", "Steps taken (a restored checkpoint's too): the data position.")

    param_shardings = property(lambda self: self.layout.shardings.params,
                               doc="The ``NamedSharding`` of every parameter.")  # fmt: skip

    @property
    def state(self) -> TrainState:
        """The training state, global arrays in their shardings (rebuilt from the flat list
        of arrays the compiled step reads and writes; PRNG keys held as their key data)."""
        return self._run.state() if self.allocated else self._planned

    @state.setter
    def state(self, state: TrainState) -> None:
        self._planned = None if self.allocated else state
        self._run = RunState.of(state, getattr(self, "_run", None))

    program = property(lambda self: self._train, doc="The compiled step (a ``Program``).")

    compiled = reads("_train", "compiled", "The compiled step (``jax.stages.Compiled``), or None.")
    jaxpr = reads("_train", "jaxpr", "The traced training step, or None before compiling.")
    batch_shardings = reads("_train", "batch_shardings", "A ``NamedSharding`` per batch leaf.")

    @property
    def model(self) -> Any:
        """The model with the current parameters, in its framework's own form, in
        evaluation mode (dropout off, batch statistics read from the running averages)."""
        s = self.state
        return self.adapter.bind(s.params, s.model_state, rng=step_key(s), train=False)

    def compile(self, batch: Any) -> None:
        """Choose the batch shardings and compile the step for batches shaped like ``batch``.

        ``fit`` does this on its first batch; call it earlier to check a batch against the
        strategy (a batch that does not split raises :class:`BatchError`) or to time the
        compilation apart from training. Later batches must look alike.
        """
        if self._train is not None:
            feed.check(batch, 0, self._train.signature)
            return
        feed.check_resumed(feed.signature(batch), self.restored_meta)  # a restore came first
        start = time.perf_counter()
        # the model alone, traced: its normaliser, its FLOPs and its weights' roles
        self._loss_normalised, flops, self.roles = programs.loss_facts(
            self.adapter, self.loss_fn, batch, self.mesh)  # fmt: skip
        self._train = self._build(batch)
        if self.settings.flops_per_sample is None and flops is not None:
            self._train = self._train._replace(model_flops=flops)
        self.compile_seconds = time.perf_counter() - start
        warn_if_float32(self._train.jaxpr, self.precision)

    def lower(self, batch: Any) -> Any:
        """The training step for batches shaped like ``batch``, lowered but not compiled: a
        ``jax.stages.Lowered`` (``.as_text()``, ``.compile()``)."""
        if self._train is None:  # the facts compile reads, for the step it would build
            self._loss_normalised, _, self.roles = programs.loss_facts(
                self.adapter, self.loss_fn, batch, self.mesh)  # fmt: skip
        return self._build(batch, how=programs.lower)[0]

    def _build(self, batch: Any, train: bool = True, how: Callable = programs.build) -> Any:
        """The training (or evaluation) step for batches like ``batch``, built ``how`` says,
        on the layout it can run on (read again after a move to explicit axes)."""

        def built() -> Any:
            step_for = programs.step_maker(
                self.adapter, self.loss_fn, self.optimizer, self.strategy, self.mesh,
                self.settings, self.state_shardings, self._loss_normalised, train, self.roles,
            )  # fmt: skip
            return how(step_for, batch, strategy=self.strategy, mesh=self.mesh, run=self._run,
                       state_shardings=self.state_shardings,
                       microbatches=self.grad_accum if train else 1)  # fmt: skip

        return self._on_layout(built)

    def evaluate(self, batches: Iterable[Any], steps: int | None = None) -> dict[str, float]:
        """The mean loss and metrics over ``batches``, the model in evaluation mode
        (:func:`shardplug.loop.evaluate.evaluate`: nothing is updated, batch statistics are
        read, ``steps`` bounds the batches read). Evaluation batches may differ in shape from
        training batches; they are compiled for once, on the first."""
        self._runs("evaluate")
        return evaluate(self._run, self._eval_program, batches, steps)

    def _eval_program(self, batch: Any) -> Program:
        self._eval = self._eval or self._build(batch, train=False)
        return self._eval

    def fit(
        self, batches: Iterable[Any], steps: int, *,
        callback: Callable[[list[dict[str, float]]], None] | None = None,
        eval_data: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
        eval_every: int | None = None, eval_steps: int | None = None,
    ) -> list[dict[str, float]]:  # fmt: skip
        """Train for ``steps`` steps on ``batches``, continuing from any earlier ``fit``.

        :param batches: an iterable of batches (pytrees of arrays); ``steps`` of them are
            consumed. In a multi-process run each process passes its own block of rows
            (:func:`shardplug.running.distributed.process_rows`), and the global batch is assembled
            from the processes' blocks. Training stops early, with a warning, if it runs
            out. After :meth:`restore`, pass the batches from :attr:`step` on.
        :param callback: called with the new history rows each time the loop reads metrics.
        :param eval_data: held-out batches (or a function returning them) that
            :meth:`evaluate` reads every ``eval_every`` steps (``eval_steps`` of them), into
            the rows as ``eval_*``.
        :return: this call's history rows: ``step`` (counted across calls and restores, from
            0), ``loss``, the loss function's metrics, ``step_time`` (seconds) and
            ``samples_per_sec`` (and ``skipped``, with ``on_nonfinite="skip"``).
            ``trainer.history`` holds the rows of every call.
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"steps must be a positive integer, got {steps!r}")
        if self._saver is not None and self._run.saved_step is None:
            self._saver.refuse_existing()
        self._runs("train")
        evaluating = periodic(eval_data, eval_every, eval_steps, self.evaluate)
        try:
            iterator = iter(batches)
        except TypeError:
            raise ConfigError(f"fit(batches={batches!r}): give an iterable of batches (a list, "
                              "a generator, a Grain dataset's iterator)") from None  # fmt: skip
        if stateful(iterator):  # Grain's: its state goes into every checkpoint
            iterator = self._data = Tracked.resumed(iterator, self.step, self._data_state)
            self._data_state = None
        if not self._said:  # the run's first line, once
            say_devices(self.strategy.name, self.mesh, self.precision, self.precision_reason)
            self._said = True
        if self._train is None:  # compile on the first batch, in this thread
            iterator = compiled_on_first(iterator, self.compile, steps)
            if iterator is None:
                return []
        return run(self.settings, self._train, self._run, iterator, steps, mesh=self.mesh,
                   checkpoints=self._saver, callback=callback, evaluate=evaluating)  # fmt: skip

    def save(self) -> str:
        """Checkpoint the current state now (in the background); returns its path."""
        if self._saver is None:
            raise ConfigError("this Trainer has no checkpoint_dir to save into")
        return self._saver.save(self._run)

    def restore(self, step: int | None = None) -> int:
        """Continue from the newest good checkpoint in ``checkpoint_dir`` (or ``step``), read
        into this trainer's shardings (any strategy, device count or mesh); returns the step,
        also :attr:`step`. A damaged checkpoint is said, set aside (``<step>.damaged``) and
        the one before used; :class:`CheckpointError` when none is left or for another model
        (naming the arrays that differ); :class:`BatchError` for a step compiled already for
        batches shaped otherwise than the checkpoint's run read, the trainer as it was."""
        if self._saver is None:
            raise ConfigError("this Trainer has no checkpoint_dir to restore from")
        state, meta = self._saver.restore(self.state, self.state_shardings, step)
        if self._train is not None:  # compiled first (as the command line does): check it now
            feed.check_resumed(self._train.signature, meta)
        self.state = state
        self.restored_meta = self._run.resumed(meta)
        self._data_state = meta.get("data_state", SKIP)  # older checkpoints: skip to the step
        return self.step

    def _runs(self, what: str) -> None:
        if not self.allocated:
            raise ConfigError(f"this Trainer plans (allocate=False): it compiles, it does not "
                              f"{what}")  # fmt: skip

    last_checkpoint = property(
        lambda self: None if self._saver is None else self._saver.last(self._run),
        doc="The path of the newest checkpoint saved or restored by this trainer, if any.")


__all__ = ["Trainer"]
