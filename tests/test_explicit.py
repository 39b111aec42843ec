"""Models written in JAX's explicit sharding mode train under every parallelism to the losses
of the same model on one device, on meshes whose axes are ``AxisType.Explicit``."""

import functools
import itertools
from contextlib import nullcontext

import explicit_models as em
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug

STEPS = 3


def _losses(adapter, loss_fn, batches, strategy, devices=None, **kwargs):
    trainer = shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optax.adam(1e-2), strategy=strategy,
        devices=devices, **kwargs,
    )  # fmt: skip
    rows = trainer.fit(itertools.islice(batches, STEPS), steps=STEPS)
    return [r["loss"] for r in rows], trainer


@functools.cache
def _one_device(kind: str) -> tuple[float, ...]:
    return tuple(_losses(*_case(kind), "dp", devices=1)[0])


def _case(kind: str):
    if kind == "transformer":
        return shardplug.from_nnx(em.Transformer), em.lm_loss, em.lm_batches()
    if kind == "linen":
        adapter = shardplug.from_linen(em.LinenMLP(16), np.zeros((1, 16), np.float32))
        return adapter, em.regression_loss, em.regression_batches(16)
    adapter = shardplug.from_equinox(lambda key: em.EquinoxMLP(16, key), rules=em.EQUINOX_RULES)
    return adapter, em.regression_loss, em.regression_batches(16)


def _strategy(name: str):
    return shardplug.get_strategy(name, min_size=0) if "fsdp" in name or "tp" in name else name


@pytest.mark.parametrize(
    ("name", "devices"),
    [("dp", 8), ("fsdp", 8), ("tp", 8), ("dp+fsdp", 8), ("fsdp+tp", 8), ("dp+fsdp+tp", 8),
     ("pp", 2), ("pp+fsdp+tp", 8)],
)  # fmt: skip
def test_an_explicit_mode_transformer_trains_like_one_device(name, devices):
    # pp alone splits no batch or activation: the model's specs name no axis, and it would
    # run on auto axes; asked for, it runs on explicit ones
    asked = {"axis_types": "explicit"} if name == "pp" else {}
    falls_back = name == "pp+fsdp+tp"  # rows split over fsdp: pp's default runs GPipe, said
    said = pytest.warns(shardplug.ShardplugWarning, match="pp runs gpipe")
    with said if falls_back else nullcontext():
        losses, trainer = _losses(*_case("transformer"), _strategy(name), devices=devices,
                                  **asked)  # fmt: skip
    np.testing.assert_allclose(losses, _one_device("transformer"), rtol=1e-4)
    assert trainer.axis_types == "explicit"
    if not asked:
        assert "model's code needs explicit axes" in trainer.axis_types_reason
    assert all(t == AxisType.Explicit for t in trainer.mesh.axis_types)
    # the parallelisms still place the parameters: the MLP's hidden units over tensor
    # parallelism's axis, the rest of the layer stored split over fsdp's
    wi = trainer.param_shardings["blocks"]["wi"].spec
    if "tp" in name:
        assert "model" in jax.tree.leaves(tuple(wi))
    if "fsdp" in name:
        assert "fsdp" in jax.tree.leaves(tuple(wi))


@pytest.mark.parametrize("kind", ["linen", "equinox"])
@pytest.mark.parametrize("name", ["dp", "fsdp+tp"])
def test_linen_and_equinox_models_that_reshard_train_like_one_device(kind, name):
    losses, trainer = _losses(*_case(kind), _strategy(name), devices=8)
    np.testing.assert_allclose(losses, _one_device(kind), rtol=1e-4)
    assert trainer.axis_types == "explicit"


def _dot_relu_dot(strategy, devices, **kwargs):
    adapter = shardplug.from_nnx(lambda rngs: em.DotReluDot(16, rngs))
    return _losses(adapter, em.regression_loss, em.regression_batches(16), strategy,
                   devices=devices, **kwargs)  # fmt: skip


def test_a_model_naming_mesh_axes_places_its_own_parameters():
    """Flax's DotReluDot names the axis "model" itself: under 2d (data x model) and under
    fsdp+tp with fsdp's axis named "data", its annotations decide where it is used."""
    want, _ = _dot_relu_dot("2d", 1)
    for strategy, kwargs in (("2d", {}), ("fsdp+tp", {"axis_names": {"fsdp": "data"}})):
        losses, trainer = _dot_relu_dot(strategy, 8, **kwargs)
        np.testing.assert_allclose(losses, want, rtol=1e-4)
        assert trainer.param_shardings["w2"].spec[0] == "model"
        assert trainer.param_shardings["dot1"]["kernel"].spec[-1] == "model"


def test_a_batch_split_over_an_axis_the_model_uses_otherwise_is_one_line():
    """fsdp renamed onto "model" splits the batch's rows over ("data", "model"), and the
    model's own product then puts "model" on two dimensions: JAX refuses, in one line."""
    with pytest.raises(shardplug.ConfigError) as info:
        _dot_relu_dot("dp+fsdp", 8, axis_names={"fsdp": "model"})
    message = str(info.value)
    assert "the batch's rows are split over ('data', 'model')" in message
    assert len(message.splitlines()) == 1


def test_the_mode_is_asked_for_or_chosen_and_said():
    adapter = shardplug.from_nnx(lambda rngs: em.DotReluDot(16, rngs))
    batches = em.regression_batches(16)
    with pytest.raises(shardplug.ConfigError, match=r"needs explicit mesh axes .* 'auto' was"):
        _losses(adapter, em.regression_loss, batches, "2d", devices=8, axis_types="auto")
    model = shardplug.get_model("mlp")
    plain = shardplug.Trainer(model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1))
    assert (plain.axis_types, plain.mesh.axis_types) == ("auto", (AxisType.Auto,))
    asked = shardplug.Trainer(
        model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1), axis_types="explicit"
    )
    assert (asked.axis_types, asked.axis_types_reason) == ("explicit", "asked for")
    with pytest.raises(shardplug.ConfigError, match="axis_types must be"):
        shardplug.Trainer(model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1),
                          axis_types="Explicit")  # fmt: skip


def test_parameters_on_an_explicit_mesh_choose_explicit_axes():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        model = em.DotReluDot(16, nnx.Rngs(0))
        model.w2[...] = jax.sharding.reshard(model.w2[...], P("model", None))
    assert isinstance(model.w2[...].sharding, NamedSharding)
    trainer = shardplug.Trainer(
        shardplug.from_nnx(model), loss_fn=em.regression_loss, optimizer=optax.sgd(0.1),
        strategy="2d",
    )  # fmt: skip
    assert trainer.axis_types == "explicit"
    assert "parameters live on a mesh with explicit axes" in trainer.axis_types_reason


def test_pmap_refuses_explicit_axes_with_its_reason():
    model = shardplug.get_model("mlp")
    with pytest.raises(shardplug.ConfigError, match="'pmap' does not run on explicit mesh axes"):
        shardplug.Trainer(model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1),
                          strategy="pmap", axis_types="explicit")  # fmt: skip


def test_attention_on_explicitly_sharded_inputs_is_xlas():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q = jax.random.normal(jax.random.key(0), (4, 8, 4, 8))
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, P("data", None, "model", None))
        out = jax.jit(lambda x: shardplug.attention(x, x, x, causal=True))(qs)
        assert jax.typeof(out).sharding.spec == P("data", None, "model", None)
    want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_explain_says_the_mode_and_who_placed_each_parameter():
    from shardplug.planning.explain import explain

    adapter = shardplug.from_nnx(lambda rngs: em.DotReluDot(16, rngs))
    trainer = shardplug.Trainer(
        adapter, loss_fn=em.regression_loss, optimizer=optax.adam(1e-2),
        strategy=shardplug.get_strategy("fsdp+tp", min_size=0, axis_names={"fsdp": "data"}),
    )  # fmt: skip
    report = explain(trainer, next(em.regression_batches(16)))
    assert report.axis_types["types"] == "explicit"
    assert "needs explicit axes" in report.axis_types["why"]
    placed = {p.path: p.placed_by for p in report.params}
    assert placed == {
        "dot1/kernel": "model, stored split by fsdp",
        "w2": "model, stored split by fsdp",
    }
    model = shardplug.get_model("mlp")
    plain = explain(
        shardplug.Trainer(model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1),
                          strategy="fsdp"),
        next(model.batches(64, 0)),
    )  # fmt: skip
    assert plain.axis_types["types"] == "auto"
    assert {p.placed_by for p in plain.params} == {"fsdp"}


def test_the_command_line_offers_the_same_axis_types():
    from shardplug.cli.parser import AXIS_TYPES
    from shardplug.core.mesh import AXIS_TYPES as CORE

    assert AXIS_TYPES == CORE


def test_a_hook_sees_jax_s_own_with_sharding_constraint():
    """Core patches no JAX function around a hook: on explicit axes a hook lays arrays out
    with shardplug.plugin.lay_out, and JAX's with_sharding_constraint (an assert there) fails
    with a line that says so."""
    from shardplug.core.registry import Strategy, StrategyInfo
    from shardplug.plugin import P, hookimpl

    seen = []

    class Looks:
        @hookimpl
        def gather_params(self, params):
            seen.append(jax.lax.with_sharding_constraint)
            return jax.tree.map(lambda p: jax.lax.with_sharding_constraint(p, P()), params)

    original = jax.lax.with_sharding_constraint
    strategy = Strategy(StrategyInfo("looks", "l", "tests", "0"), Looks())
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    split = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh), pytest.raises(shardplug.PluginError, match=r"asserts.*lay_out"):
        jax.jit(lambda p: strategy.gather_params(p, mesh)).trace(split)
    assert seen == [original]


@pytest.mark.parametrize(
    ("model", "adapter", "strategy"),
    [("mlp", "nnx", "tp"), ("transformer", "linen", "dp"), ("cnn", "equinox", "2d")],
)
def test_explicit_axes_on_a_model_that_does_not_name_them_are_one_line(
    model, adapter, strategy, capsys
):
    from shardplug.cli import main

    argv = ["train", "--model", model, "--adapter", adapter, "--strategy", strategy,
            "--axis-types", "explicit", "--steps", "1", "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "JAX refuses on explicit axes" in err[0], err[:3]
