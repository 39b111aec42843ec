"""The trainer's loop: continuation, one compilation, donation, metrics and typed errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import reference_trainer

import shardplug
from shardplug.models.nnx_models import regressor

MLP = shardplug.get_model("mlp")


def trainer_for(model=MLP, strategy="fsdp", **kwargs):
    return reference_trainer(model, strategy, optimizer=optax.adam(3e-3), **kwargs)[1]


def test_fit_again_continues_where_it_stopped():
    whole = trainer_for().fit(MLP.batches(64, 0), steps=10)
    trainer = trainer_for(log_every=3)
    batches = MLP.batches(64, 0)
    first = trainer.fit(batches, steps=4)
    second = trainer.fit(batches, steps=6)
    assert [r["step"] for r in first + second] == list(range(10))
    assert trainer.history == first + second
    np.testing.assert_allclose(
        [r["loss"] for r in trainer.history], [r["loss"] for r in whole], rtol=1e-6
    )
    assert int(trainer.state.step) == 10


def test_step_is_traced_once_and_old_state_is_donated():
    traces = []

    def loss_fn(model, batch):
        traces.append(1)
        return MLP.loss_fn(model, batch)

    trainer = trainer_for(loss_fn=loss_fn)
    trainer.fit(MLP.batches(64, 0), steps=2)
    old = jax.tree.leaves(trainer.state.params)
    trainer.fit(MLP.batches(64, 2), steps=5)
    # the step once, and the loss alone once (the model's FLOPs and its normaliser)
    assert len(traces) == 2
    assert all(a.is_deleted() for a in old)


def test_history_rows_carry_metrics_and_timing():
    rows = trainer_for(shardplug.get_model("classifier")).fit(
        shardplug.get_model("classifier").batches(64, 0), steps=30
    )
    hardware = {"step_tflops", "model_tflops", "memory_in_use", "memory_peak", "comm_share"}
    assert set(rows[0]) == {"step", "loss", "accuracy", "step_time", "samples_per_sec", *hardware}
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert all(r["step_time"] > 0 and r["samples_per_sec"] > 0 for r in rows)


def test_built_model_trains_and_the_callers_copy_survives():
    with nnx.use_eager_sharding(False):
        model = regressor(nnx.Rngs(0))
    kernel = np.asarray(model.fc1.kernel[...])
    trainer = shardplug.Trainer(
        shardplug.from_nnx(model), loss_fn=MLP.loss_fn, optimizer=optax.adam(3e-3), strategy="fsdp"
    )
    rows = trainer.fit(MLP.batches(64, 0), steps=5)
    assert rows[-1]["loss"] < rows[0]["loss"]
    np.testing.assert_array_equal(np.asarray(model.fc1.kernel[...]), kernel)  # not donated
    trained = trainer.model
    assert isinstance(trained, nnx.Module)
    assert not np.allclose(np.asarray(trained.fc1.kernel[...]), kernel)
    # the model the trainer hands back computes what the last step computed
    batch = next(MLP.batches(64, 5))
    assert jnp.isfinite(MLP.loss_fn(trained, batch)[0])


def test_built_model_and_factory_start_from_the_same_loss():
    with nnx.use_eager_sharding(False):
        built = regressor(nnx.Rngs(jax.random.key(0)))
    a = shardplug.Trainer(
        shardplug.from_nnx(built), loss_fn=MLP.loss_fn, optimizer=optax.adam(3e-3)
    ).fit(MLP.batches(64, 0), steps=3)
    b = trainer_for(strategy="dp").fit(MLP.batches(64, 0), steps=3)
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-6)


def test_non_scalar_loss_is_refused():
    trainer = trainer_for(loss_fn=lambda model, batch: model(batch["x"]))
    with pytest.raises(shardplug.ConfigError, match="scalar loss, got shape"):
        trainer.fit(MLP.batches(64, 0), steps=1)


def test_a_batch_of_another_shape_is_refused():
    trainer = trainer_for()
    batches = iter([next(MLP.batches(64, 0)), next(MLP.batches(32, 0))])
    with pytest.raises(shardplug.BatchError, match="batch 1 differs from the first batch"):
        trainer.fit(batches, steps=2)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap"])
def test_a_batch_that_does_not_split_is_refused(strategy):
    with pytest.raises(shardplug.BatchError, match="use a global batch size that is a multiple"):
        trainer_for(strategy=strategy).fit(MLP.batches(30, 0), steps=1)


@pytest.mark.parametrize("steps", [0, -3, 1.5, True])
def test_steps_must_be_positive(steps):
    with pytest.raises(shardplug.ConfigError, match="steps must be a positive integer"):
        trainer_for().fit(MLP.batches(64, 0), steps=steps)


def test_running_out_of_batches_warns_and_stops():
    batches = [next(MLP.batches(64, 0))] * 3
    with pytest.warns(UserWarning, match="batches ran out after 3 of 5 steps"):
        rows = trainer_for().fit(batches, steps=5)
    assert len(rows) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"strategy": "zero"},
            shardplug.UnknownStrategyError,
            "available: 2d, cp, dp, ep, fsdp, pmap",
        ),
        ({"mesh": "fsdp=3"}, shardplug.MeshError, "has 3 devices but the run has 8"),
        ({"mesh": "data=8"}, shardplug.MeshError, "mesh axis 'data' is not an axis of this"),
        ({"devices": 12}, shardplug.DeviceError, "asked for 12 devices"),
        ({"log_every": 0}, shardplug.ConfigError, "log_every must be a positive integer"),
    ],
)
def test_bad_trainer_arguments_raise_typed_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        trainer_for(**kwargs)


def test_trainer_needs_an_adapter():
    with pytest.raises(shardplug.ConfigError, match=r"shardplug.from_nnx\(model\)"):
        shardplug.Trainer(regressor, loss_fn=MLP.loss_fn, optimizer=optax.sgd(0.1))


def test_fewer_devices_than_exist():
    trainer = trainer_for(devices=2)
    assert trainer.mesh.size == 2
    rows = trainer.fit(MLP.batches(64, 0), steps=2)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_a_later_fit_still_reports_throughput():
    trainer = trainer_for(log_every=4)
    batches = MLP.batches(64, 0)
    trainer.fit(batches, steps=4)
    later = trainer.fit(batches, steps=4)
    assert all(r["samples_per_sec"] > 0 for r in later)
    assert later[0]["samples_per_sec"] == pytest.approx(64 / later[0]["step_time"])


# What the user owns stays theirs: a model or variables passed in are copied into the
# strategy's shardings, never aliased, so the donating step cannot delete or change them.
def _owned(framework, strategy):
    import equinox as eqx
    import flax.linen as nn

    x = np.ones((16, 4), np.float32)
    if strategy == "pp":  # a pipeline needs a layer stack
        return _owned_stack(framework, x)
    if framework == "nnx":
        module = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        return (
            shardplug.from_nnx(module),
            nnx.state(module, nnx.Param),
            lambda m, b: jnp.mean(m(b["x"]) ** 2),
        )
    if framework.startswith("linen"):
        dense = nn.Dense(2)
        variables = dense.init(jax.random.key(0), x)
        if framework == "linen-numpy":  # variables as NumPy arrays, read-only or not
            variables = jax.tree.map(np.array, variables)
        adapter = shardplug.from_linen(dense, variables=variables)
        return adapter, variables, lambda m, b: jnp.mean(m(b["x"]) ** 2)
    model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
    return shardplug.from_equinox(model), model, lambda m, b: jnp.mean(jax.vmap(m)(b["x"]) ** 2)


def _owned_stack(framework, x):
    """Eight blocks as one shardplug.stack, written without sharding annotations."""
    import equinox as eqx
    import flax.linen as nn

    from shardplug import stack

    loss_fn = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    if framework == "nnx":

        class Block(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(4, 4, rngs=rngs)

            def __call__(self, h):
                return jnp.tanh(self.lin(h))

        class Deep(nnx.Module):
            def __init__(self, rngs):
                self.blocks = stack.nnx_layers(Block, 8, rngs)  # names 'layers' itself

            def __call__(self, h):
                return stack.apply(self.blocks, h)

        model = Deep(nnx.Rngs(0))
        return shardplug.from_nnx(model), nnx.state(model, nnx.Param), loss_fn
    rules = {r"blocks/.*": ("layers",)}
    if framework.startswith("linen"):

        class LinenBlock(nn.Module):
            @nn.compact
            def __call__(self, h):
                return jnp.tanh(nn.Dense(4)(h))

        class LinenDeep(nn.Module):
            @nn.compact
            def __call__(self, h):
                return stack.LinenLayers(LinenBlock, 8, name="blocks")(h)

        variables = LinenDeep().init(jax.random.key(0), x)
        if framework == "linen-numpy":
            variables = jax.tree.map(np.array, variables)
        return (
            shardplug.from_linen(LinenDeep(), variables=variables, rules=rules),
            variables,
            loss_fn,
        )

    class EqxBlock(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self, key):
            self.lin = eqx.nn.Linear(4, 4, key=key)

        def __call__(self, h):
            return jnp.tanh(jax.vmap(self.lin)(h))

    class EqxDeep(eqx.Module):
        blocks: EqxBlock

        def __init__(self, key):
            self.blocks = stack.equinox_layers(EqxBlock, 8, key)

        def __call__(self, h):
            return stack.apply(self.blocks, h)

    model = EqxDeep(jax.random.key(0))
    return shardplug.from_equinox(model, rules=rules), model, loss_fn


@pytest.mark.parametrize("framework", ["nnx", "linen", "linen-numpy", "equinox"])
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap", "fsdp+tp", "dp+fsdp", "pp"])
def test_the_users_model_and_arrays_are_valid_and_unchanged_after_training(framework, strategy):
    adapter, owned, loss_fn = _owned(framework, strategy)
    leaves = [x for x in jax.tree.leaves(owned) if hasattr(x, "shape")]
    before = [np.array(x) for x in leaves]
    for _ in range(2):  # a second trainer from the same model, as the guide promises
        trainer = shardplug.Trainer(
            adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.05), strategy=strategy
        )
        rows = trainer.fit([{"x": np.ones((16, 4), np.float32)}] * 2, steps=2)
        assert rows[-1]["loss"] < rows[0]["loss"]  # it trained ...
    for x, was in zip(leaves, before, strict=True):  # ... and the user's arrays are intact
        np.testing.assert_array_equal(np.asarray(x), was)


def test_a_runs_first_line_says_how_many_devices_it_uses_and_why(capsys):
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.1), strategy="fsdp", devices=2)  # fmt: skip
    trainer.fit(model.batches(8, 0), steps=1)
    trainer.fit(model.batches(8, 0), steps=1)  # said once
    err = capsys.readouterr().err
    assert err == (
        "shardplug: fsdp on 2 cpu devices (fsdp=2): 2 of the 8 JAX has, as asked; "
        "float32 (a CPU has no bfloat16 matrix units)\n"
    )
