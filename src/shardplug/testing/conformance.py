"""The conformance suite every strategy must pass.

A plugin author subclasses it in a test file::

    from shardplug.testing import StrategyConformance

    class TestMyStrategy(StrategyConformance):
        strategy = "my-strategy"

and pytest runs the checks, the first of them over every adapter x reference model (the
``shardplug_adapter`` and ``shardplug_model`` fixtures of shardplug's pytest plugin).

A strategy that cannot support something says so on its plugin object, and the check is
skipped with that reason shown::

    class MyStrategy:
        unsupported = {"equinox": "needs NNX metadata", "uneven-shapes": "..."}

A strategy runs on ``Auto`` mesh axes in every check and on ``Explicit`` ones in
``test_trains_like_one_device_on_explicit_axes`` (unless it declares ``explicit-axes``
unsupported).

Capabilities: the adapters (``nnx``, ``linen``, ``equinox``), ``model-state`` (models with
batch statistics: the ``cnn``), ``uneven-shapes``, ``batch-split`` (a strategy that
replicates the batch by design, such as pure tensor parallelism), ``without-layer-stack`` and
``explicit-axes`` (:class:`shardplug.plugin.Capability`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import pytest

from shardplug.plugin import Capability

#: what only the transformer among the reference models has: a layer stack and a sequence
TRANSFORMER_ONLY = (
    Capability.WITHOUT_LAYER_STACK, Capability.WITHOUT_SEQUENCE, Capability.WITHOUT_EXPERTS
)  # fmt: skip
#: the transformer's mixture of experts for a plugin that needs one (``without-experts``)
EXPERTS = {"experts": 8, "top_k": 2}

#: per-step loss tolerance against one device, float32 (reductions reorder across devices)
RTOL = {"mlp": 1e-5, "classifier": 1e-5, "transformer": 1e-4, "cnn": 1e-4}


@functools.cache
def one_device_losses(
    adapter: str, model_name: str, steps: int, seed: int, model_options: tuple = ()
) -> tuple[float, ...]:
    """The reference trajectory: the same model and data on a single device (the default
    strategy, the plainest: nothing split on one device)."""
    return tuple(_losses(None, {}, adapter, model_name, steps, seed, devices=1, mesh=None,
                         model_options=dict(model_options)))  # fmt: skip


def _trainer(strategy, options, adapter, model_name, seed, devices, mesh, model_options=None):
    """A trainer of a reference model under ``strategy`` (a name, with ``options``, or a
    strategy already made)."""
    import optax

    import shardplug

    model = shardplug.get_model(model_name)
    taken = {k: v for k, v in (model_options or {}).items() if k in model.options}
    task = shardplug.Task(
        model.adapter(adapter, **taken), model.loss_fn, optax.adam(model.learning_rate), data=()
    )
    made = shardplug.get_strategy(strategy, **options) if isinstance(strategy, str) else strategy
    return model, task.trainer(
        strategy=made,
        devices=devices,
        mesh=mesh,
        seed=seed,
        precision="float32",  # trajectories compared to one device's within float32's noise
    )


def _losses(strategy, options, adapter, model_name, steps, seed, devices, mesh, model_options):
    model, trainer = _trainer(
        strategy, options, adapter, model_name, seed, devices, mesh, model_options
    )
    return [r["loss"] for r in trainer.fit(model.batches(model.batch_size, seed), steps=steps)]


def _explicit_losses(strategy, devices, mesh, steps, seed, experts=False) -> list[float]:
    import itertools

    import optax

    import shardplug
    from shardplug.testing import explicit

    net = explicit.ExpertNet if experts else explicit.ResidualNet
    task = shardplug.Task(shardplug.from_nnx(net), explicit.loss_fn, optax.adam(3e-3), data=())
    trainer = task.trainer(strategy=strategy, devices=devices, mesh=mesh,
                           axis_types="explicit", seed=seed, precision="float32")  # fmt: skip
    data = itertools.islice(explicit.batches(seed), steps)
    return [r["loss"] for r in trainer.fit(data, steps=steps)]


@functools.cache
def _explicit_one_device(steps: int, seed: int, experts: bool = False) -> tuple[float, ...]:
    return tuple(_explicit_losses(None, 1, None, steps, seed, experts))


class StrategyConformance:
    """Checks that a strategy trains exactly like one device and places arrays as it says.

    Set ``strategy`` (its entry-point name); optionally ``options`` (for ``get_strategy``),
    ``devices``, ``mesh`` and ``model_options`` (for the models that take them: the
    transformer's ``layers``). A strategy that needs a layer stack (``pp``) declares
    ``without-layer-stack`` unsupported (``cp``: ``without-sequence``), and the checks run on
    the transformer.
    """

    strategy: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    devices: ClassVar[int] = 8
    mesh: ClassVar[str | None] = None
    steps: ClassVar[int] = 5
    seed: ClassVar[int] = 0
    model_options: ClassVar[dict[str, Any]] = {}

    def _strategy(self):
        import shardplug

        return shardplug.get_strategy(self.strategy, **self.options)

    def requires(self, capability: Capability | str) -> None:
        """Skip the calling check, showing the plugin's reason, where the strategy declares
        ``capability`` unsupported: a built-in :class:`Capability` or one its plugin declares
        in ``capabilities`` (for the checks a plugin's own suite adds)::

            class TestMine(StrategyConformance):
                strategy = "mine"

                def test_sliding_windows(self):
                    self.requires("sliding-window")
                    ...
        """
        strategy = self._strategy()
        known = {*(c.value for c in Capability), *strategy.capabilities}
        if capability not in known:
            raise ValueError(
                f"{capability!r} is not a capability ({', '.join(sorted(known))}): declare it "
                f"in the plugin's capabilities"
            )
        unsupported = strategy.unsupported
        if capability in unsupported:
            pytest.skip(f"{self.strategy} does not support {capability}: {unsupported[capability]}")

    _skip_unless = requires

    def _needs_transformer(self) -> bool:
        unsupported = self._strategy().unsupported
        return any(c in unsupported for c in TRANSFORMER_ONLY)

    def _model_options(self) -> dict[str, Any]:
        """``model_options``, with the transformer's experts for a plugin that needs them."""
        if Capability.WITHOUT_EXPERTS in self._strategy().unsupported:
            return {**EXPERTS, **self.model_options}
        return dict(self.model_options)

    def _trainer(self, adapter: str = "nnx", model: str | None = None):
        model = model or ("transformer" if self._needs_transformer() else "mlp")
        return _trainer(
            self.strategy, self.options, adapter, model, self.seed, self.devices, self.mesh,
            self._model_options(),
        )  # fmt: skip

    def test_trains_like_one_device(self, shardplug_adapter: str, shardplug_model: str) -> None:
        import numpy as np

        self._skip_unless(shardplug_adapter)
        if shardplug_model == "cnn":
            self._skip_unless(Capability.MODEL_STATE)
        import shardplug

        if "layers" not in shardplug.get_model(shardplug_model).options:
            for capability in TRANSFORMER_ONLY:  # only the transformer has both
                self._skip_unless(capability)
        losses = _losses(
            self.strategy,
            self.options,
            shardplug_adapter,
            shardplug_model,
            self.steps,
            self.seed,
            self.devices,
            self.mesh,
            self._model_options(),
        )
        taken = (
            tuple(sorted(self._model_options().items())) if shardplug_model == "transformer" else ()
        )
        expected = one_device_losses(
            shardplug_adapter, shardplug_model, self.steps, self.seed, taken
        )
        np.testing.assert_allclose(losses, expected, rtol=RTOL.get(shardplug_model, 1e-4))

    def test_every_pipeline_schedule_trains_like_one_device(
        self, shardplug_adapter: str, shardplug_schedule: str
    ) -> None:
        """A strategy with a pipeline schedule to choose (an option named ``schedule``: pp,
        alone or composed) trains the transformer like one device under every installed
        schedule (its default is the check above): two chunks of layers per stage for an
        interleaved one (or the count a schedule runs alone: ZB-V's 2)."""
        import numpy as np

        from shardplug.core.registry import strategy_options
        from shardplug.strategies.pp.schedules import find_schedule

        if "schedule" not in {o.name for o in strategy_options(self.strategy)}:
            pytest.skip(f"{self.strategy} has no pipeline schedule to choose")
        self._skip_unless(shardplug_adapter)
        options = {**self.options, "schedule": shardplug_schedule}
        model_options = self._model_options()
        if shardplug_schedule != "gpipe" and find_schedule(shardplug_schedule).chunked:
            repeats = find_schedule(shardplug_schedule).repeats or 2
            options["repeats"] = repeats
            model_options["layers"] = repeats * model_options.get("layers", 4)
        losses = _losses(self.strategy, options, shardplug_adapter, "transformer", self.steps,
                         self.seed, self.devices, self.mesh, model_options)  # fmt: skip
        expected = one_device_losses(shardplug_adapter, "transformer", self.steps, self.seed,
                                     tuple(sorted(model_options.items())))  # fmt: skip
        np.testing.assert_allclose(losses, expected, rtol=RTOL["transformer"])

    def test_trains_like_one_device_on_explicit_axes(self) -> None:
        """A model written for explicit sharding mode (:mod:`shardplug.testing.explicit`; its
        ``ExpertNet`` for a plugin that needs experts) trains on the strategy's mesh with
        ``AxisType.Explicit`` axes like one device."""

        import numpy as np

        self._skip_unless(Capability.EXPLICIT_AXES)
        experts = Capability.WITHOUT_EXPERTS in self._strategy().unsupported
        got = _explicit_losses(
            self._strategy(), self.devices, self.mesh, self.steps, self.seed, experts
        )
        want = _explicit_one_device(self.steps, self.seed, experts)
        np.testing.assert_allclose(got, want, rtol=1e-5)

    def test_uneven_shapes_still_train(self) -> None:
        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import nnx

        import shardplug

        self._skip_unless(Capability.UNEVEN_SHAPES)

        class Uneven(nnx.Module):  # no dimension divides 8 (or most device counts)
            def __init__(self, rngs):
                self.a = nnx.Linear(13, 37, rngs=rngs)
                self.b = nnx.Linear(37, 3, rngs=rngs)

            def __call__(self, x):
                return self.b(jnp.tanh(self.a(x)))

        def loss_fn(model, batch):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        rng = np.random.default_rng(0)
        rows = 8 * self.devices
        batches = [
            {
                "x": rng.normal(size=(rows, 13)).astype(np.float32),
                "y": rng.normal(size=(rows, 3)).astype(np.float32),
            }
            for _ in range(4)
        ]

        def losses(strategy, devices, mesh):
            task = shardplug.Task(shardplug.from_nnx(Uneven), loss_fn, optax.adam(1e-2), data=())
            trainer = task.trainer(
                strategy=strategy, devices=devices, mesh=mesh, precision="float32"
            )
            return [r["loss"] for r in trainer.fit(batches, steps=4)]

        got = losses(self._strategy(), self.devices, self.mesh)
        np.testing.assert_allclose(got, losses(None, 1, None), rtol=1e-5)

    def test_keeps_the_state_where_offload_places_it(self) -> None:
        """With the built-in ``offload`` add-on (the optimizer state in host memory), the
        strategy trains as without it, to float32's last bits, and the optimizer state is in
        host memory after the steps; or, a per-device program, it refuses in one line."""
        import jax
        import numpy as np

        import shardplug

        model_name = "transformer" if self._needs_transformer() else "mlp"
        options = self._model_options()
        given = {k: v for k, v in self.options.items() if k != "addons"}
        addons = [*self.options.get("addons", ()), "offload"]  # an add-on package's own first
        strategy = shardplug.get_strategy(self.strategy, addons=addons, **given)
        model, trainer = _trainer(strategy, {}, "nnx", model_name, self.seed, self.devices,
                                  self.mesh, options)  # fmt: skip
        batches = model.batches(model.batch_size, self.seed)
        try:
            rows = trainer.fit(batches, steps=2)
        except shardplug.ConfigError as exc:
            assert "per-device program" in str(exc) and "\n" not in str(exc), str(exc)
            return
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.state.opt_state)}
        assert kinds == {"pinned_host"}, f"the optimizer state left host memory: {kinds}"
        want = _losses(self.strategy, self.options, "nnx", model_name, 2, self.seed,
                       self.devices, self.mesh, options)  # fmt: skip
        np.testing.assert_allclose([r["loss"] for r in rows], want, rtol=1e-6)

    def test_batch_is_split_not_duplicated(self) -> None:
        self._skip_unless(Capability.BATCH_SPLIT)
        model, trainer = self._trainer()
        batch = next(model.batches(model.batch_size, self.seed))
        trainer.compile(batch)
        sharding, shape = trainer.batch_shardings[model.inputs], batch[model.inputs].shape
        rows = sharding.shard_shape(shape)[0]
        assert rows < shape[0], "every device holds the whole batch"
        parts = shape[0] // rows
        distinct = {idx[0].start for idx in sharding.devices_indices_map(shape).values()}
        assert len(distinct) == parts, "the batch rows are not spread over the devices"
