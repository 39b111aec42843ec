"""``--addon float8``: the linear layers' products run in float8 under every strategy and
framework, the loss following bfloat16's; checkpoints are unchanged (a float8 run resumes
without it and back); what it cannot do is one line."""

import numpy as np
import pytest

import shardplug
from shardplug.cli import main
from shardplug.errors import ConfigError, StrategyOptionError
from shardplug.flops import product_dtypes

pytestmark = pytest.mark.filterwarnings("ignore:float8 on cpu")


def trained(strategy="dp", addons=(), framework="nnx", steps=200, mesh=None, options=None,
            **model_options):  # fmt: skip
    """The reference transformer's losses (every 20 steps) in bf16, and its trainer."""
    model = shardplug.get_model("transformer")
    task = model.task(framework, **model_options)
    made = shardplug.get_strategy(strategy, addons=list(addons), **(options or {}))
    trainer = task.trainer(strategy=made, precision="bf16", log_every=min(20, steps), mesh=mesh)
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
@pytest.mark.parametrize(("strategy", "mesh", "options"), [
    ("dp", None, {}),
    ("fsdp+tp", None, {}),
    ("pp+fsdp", "stage=2,fsdp=4", {"min_size": 0}),
    ("fsdp+cp", "fsdp=2,context=4", {}),
])  # fmt: skip
def test_float8_follows_bf16_over_200_steps_under_each_strategy(strategy, mesh, options):
    """The issue's measure: 200 steps of the built-in data, every 20 steps' loss within 2%
    of bf16's under the same strategy (measured: within 0.4% under all four), float8's
    products in the step (pp's stages make each layer's weight in their own loop)."""
    want = trained(strategy, mesh=mesh, options=options)[0]
    got, trainer = trained(strategy, ("float8",), mesh=mesh, options=options)
    assert float8_share(trainer) > 0.5
    np.testing.assert_allclose(got, want, rtol=0.02)


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
