"""``--addon float8``: the linear layers' products run in float8 under every strategy and
framework, the loss following bfloat16's; checkpoints are unchanged (a float8 run resumes
without it and back); what it cannot do is one line."""

import functools

import numpy as np
import pytest

import shardplug
from shardplug.cli import main
from shardplug.core.flops import product_dtypes
from shardplug.errors import ConfigError, StrategyOptionError

pytestmark = pytest.mark.filterwarnings("ignore:float8 on cpu")


def trained(strategy="dp", addons=(), framework="nnx", steps=200, mesh=None, options=None,
            log_every=20, **model_options):  # fmt: skip
    """The reference transformer's losses (every ``log_every`` steps) in bf16, and its
    trainer."""
    model = shardplug.get_model("transformer")
    task = model.task(framework, **model_options)
    made = shardplug.get_strategy(strategy, addons=list(addons), **(options or {}))
    every = min(log_every, steps)
    trainer = task.trainer(strategy=made, precision="bf16", log_every=every, mesh=mesh)
    trainer.fit(task.batches(), steps=steps)
    return np.array([r["loss"] for r in trainer.history]), trainer


def float8_share(trainer) -> float:
    flops = product_dtypes(trainer.jaxpr).flops
    return sum(v for k, v in flops.items() if "float8" in k) / sum(flops.values())


@pytest.mark.parametrize(("framework", "model_options"), [
    ("nnx", {}),
    pytest.param("linen", {}, marks=pytest.mark.slow),
    pytest.param("equinox", {}, marks=pytest.mark.slow),
    pytest.param("nnx", {"remat": "full"}, marks=pytest.mark.slow),
])  # fmt: skip
def test_float8_runs_the_linear_layers_products_in_every_framework(framework, model_options):
    """30 steps under dp: most of the step's matrix-product FLOPs are float8 (the targets'
    forward e4m3 by e4m3, their gradients e5m2 by e4m3), and the loss is bf16's within 2%
    while not equal to it (the products really changed)."""
    want = trained(framework=framework, steps=30, **model_options)[0]
    got, trainer = trained(addons=("float8",), framework=framework, steps=30, **model_options)
    assert float8_share(trainer) > 0.8
    flops = product_dtypes(trainer.jaxpr).flops
    assert {"float8_e4m3fn", "float8_e4m3fn x float8_e5m2"} <= flops.keys()
    np.testing.assert_allclose(got, want, rtol=0.02)
    assert not np.array_equal(got, want)


@pytest.mark.slow
def test_float8_follows_bf16_over_200_steps():
    """The issue's measure: 200 steps of the built-in data, every 20 steps' loss within 2%
    of bf16's (measured: within 0.4%), under dp. That another strategy trains float8 as dp
    does is the next test's, over 20 steps."""
    want = trained()[0]
    got, trainer = trained(addons=("float8",))
    assert float8_share(trainer) > 0.8
    np.testing.assert_allclose(got, want, rtol=0.02)


@functools.cache
def float8_on_dp():
    return trained(addons=("float8",), steps=20, log_every=1)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "mesh", "options"), [
    ("fsdp+tp", None, {}),
    ("pp+fsdp", "stage=2,fsdp=4", {"min_size": 0}),
    ("fsdp+cp", "fsdp=2,context=4", {}),
])  # fmt: skip
def test_float8_trains_under_each_strategy_as_under_dp(strategy, mesh, options):
    """Every step's loss of 20 under the strategy is float8's under dp within 0.5% (measured:
    0.13% at most, the size of bf16's own differences in summation order), float8's products
    in the step (pp's stages make each layer's weight in their own loop)."""
    got, trainer = trained(strategy, ("float8",), steps=20, log_every=1, mesh=mesh,
                           options=options)  # fmt: skip
    assert float8_share(trainer) > 0.5
    np.testing.assert_allclose(got, float8_on_dp(), rtol=5e-3)


def test_float8_options_and_what_it_cannot_do_are_one_line(capsys):
    with pytest.raises(StrategyOptionError, match="scaling must be tensor or row"):
        shardplug.get_strategy("dp", addons=["float8"], **{"float8.scaling": "block"})
    task = shardplug.get_model("transformer").task("nnx")
    made = shardplug.get_strategy("dp", addons=["float8"], **{"float8.targets": "nothing"})
    with pytest.raises(ConfigError, match="targets 'nothing' match no matrix of this model"):
        task.trainer(strategy=made, devices=1).compile(next(iter(task.batches())))
    lora = shardplug.with_lora(task, rank=2)
    with pytest.raises(ConfigError, match=r"float8 runs the products .* train with one of the"):
        lora.trainer(strategy=shardplug.get_strategy("dp", addons=["float8"]),
                     devices=1).compile(next(iter(lora.batches())))  # fmt: skip
    assert main(["train", "--model", "mlp", "--addon", "float8", "-o", "float8.targets=(",
                 "--steps", "1"]) == 2  # fmt: skip
    assert "float8 option targets '('" in capsys.readouterr().err


def test_a_float8_run_resumes_without_it_and_back(tmp_path, capsys):
    """float8 is how products run, not what is stored: the checkpoint is the same."""
    run = ["train", "--model", "mlp", "--precision", "bf16", "--checkpoint-dir",
           str(tmp_path), "--quiet"]  # fmt: skip
    assert main([*run, "--steps", "4", "--addon", "float8"]) == 0
    assert main([*run, "--steps", "6", "--resume"]) == 0
    assert main([*run, "--steps", "8", "--resume", "--addon", "float8"]) == 0
    assert "-> " in capsys.readouterr().out


def test_float8_leaves_what_it_cannot_run_and_says_where_it_runs_as_before(capsys):
    """By default a convolution's kernel and a mixture's experts are no targets (the CNN,
    all convolutions but its head, has none: one line; the mixture's attention runs in
    float8 with nothing to warn of); on explicit axes float8 steps aside, said once; under
    pp's schedules a held weight outside the layer stack (the head, asked for) is said to
    multiply as before."""
    import warnings

    from shardplug.errors import ShardplugWarning

    for model, options in (("cnn", {}), ("transformer", {"experts": 4})):
        task = shardplug.get_model(model).task("nnx", **options)
        trainer = task.trainer(strategy=shardplug.get_strategy("dp", addons=["float8"]),
                               devices=2, precision="bf16")  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardplugWarning)
            warnings.filterwarnings("ignore", "float8 on cpu")
            if model == "cnn":
                with pytest.raises(ConfigError, match="the default targets match no matrix"):
                    trainer.compile(next(iter(task.batches())))
                continue
            trainer.compile(next(iter(task.batches())))
        assert float8_share(trainer) > 0
    assert main(["train", "--model", "mlp", "--axis-types", "explicit", "--addon", "float8",
                 "--steps", "2", "--quiet", "--devices", "2"]) == 0  # fmt: skip
    assert "float8 on explicit mesh axes is not built yet" in capsys.readouterr().err
    task = shardplug.get_model("transformer").task("nnx")
    made = shardplug.get_strategy("pp+fsdp", addons=["float8"], min_size=0,
                                  **{"float8.targets": "unembed|wi"})  # fmt: skip
    with pytest.warns(ShardplugWarning, match=r"held weights outside it \(unembed\) multiply"):
        task.trainer(strategy=made, mesh="stage=2,fsdp=4").compile(next(iter(task.batches())))


def test_two_addons_hold_weights_of_their_own_and_never_the_same_one():
    from shardplug.errors import PluginError
    from shardplug.plugin import Hold, hookimpl, leaf_paths

    class Mine:
        def __init__(self, name):
            self.name = name

        @hookimpl
        def held_weights(self, params):
            return [Hold(p, "float8", (("scaling", "row"),)) if p.endswith(self.name) else None
                    for p in leaf_paths(params)]  # fmt: skip

    task = shardplug.get_model("transformer").task("nnx")
    batch = next(iter(task.batches()))
    both = shardplug.get_strategy("dp", addons=[Mine("wq"), "float8"],
                                  **{"float8.targets": "wk"})  # fmt: skip
    trainer = task.trainer(strategy=both, devices=2, precision="bf16")
    trainer.compile(batch)
    holds = trainer.strategy.held_weights(trainer.state.params, trainer.mesh)
    assert sorted(h.path for h in holds if h) == ["blocks/wk", "blocks/wq"]
    same = shardplug.get_strategy("dp", addons=[Mine("wq"), "float8"],
                                  **{"float8.targets": "wq"})  # fmt: skip
    with pytest.raises(PluginError, match="blocks/wq is held for both float8 and float8"):
        task.trainer(strategy=same, devices=2).compile(batch)
