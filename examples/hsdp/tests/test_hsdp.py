"""The example strategy passes shardplug's conformance suite, and keeps its promises."""

import json
import subprocess
import sys

import jax
import optax
import pytest

import shardplug
from shardplug.testing import StrategyConformance


class TestHSDP(StrategyConformance):
    strategy = "hsdp"


def test_parameters_split_within_a_group_and_replicated_across_groups():
    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3), strategy="hsdp"
    )
    assert dict(trainer.mesh.shape) == {"replica": 2, "fsdp": 4}
    wq = trainer.state.params["blocks"]["wq"]  # the layer stack: (layers 2, embed 64, ...)
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert wq.addressable_shards[0].data.shape == (2, 16, 4, 16)  # embed 64 / 4
    distinct = {str(s.index) for s in wq.addressable_shards}
    assert len(distinct) == 4  # each quarter held by both replica groups


def test_listed_and_trained_from_the_command_line(tmp_path):
    listing = subprocess.run(
        [sys.executable, "-m", "shardplug", "strategies", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = {r["name"]: r for r in json.loads(listing.stdout)}
    assert rows["hsdp"]["source"] == "shardplug-hsdp 0.1.0"
    finals = {}
    for strategy in ("hsdp", "dp"):
        out = tmp_path / f"{strategy}.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardplug",
                "train",
                "--strategy",
                strategy,
                "--model",
                "mlp",
                "--steps",
                "10",
                "--quiet",
                "--metrics-out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        finals[strategy] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert finals["hsdp"] == pytest.approx(finals["dp"], rel=1e-5)


def test_four_groups_train_like_two():
    model = shardplug.get_model("mlp")
    losses = {}
    for replicas in (2, 4):
        trainer = shardplug.Trainer(
            model.adapter("nnx"),
            loss_fn=model.loss_fn,
            optimizer=optax.adam(3e-3),
            strategy=shardplug.get_strategy("hsdp", replicas=replicas),
        )
        assert dict(trainer.mesh.shape) == {"replica": replicas, "fsdp": 8 // replicas}
        losses[replicas] = [r["loss"] for r in trainer.fit(model.batches(64, 0), steps=5)]
    assert losses[4] == pytest.approx(losses[2], rel=1e-5)


def test_in_the_strategy_matrix():
    from shardplug.testing.pytest_plugin import installed_strategies

    assert "hsdp" in installed_strategies()


def test_the_builtin_grad_bf16_addon_wraps_it_too():
    """An add-on wraps any strategy's hooks, a third party's included."""
    import numpy as np

    model = shardplug.get_model("cnn")

    def losses(addons):
        trainer = shardplug.Trainer(
            model.adapter("nnx"),
            loss_fn=model.loss_fn,
            optimizer=optax.adam(model.learning_rate),
            strategy=shardplug.get_strategy("hsdp", addons=addons),
        )
        return [r["loss"] for r in trainer.fit(model.batches(model.batch_size, 0), 5)]

    exact, rounded = losses([]), losses(["grad-bf16"])
    np.testing.assert_allclose(rounded, exact, rtol=2e-3)  # bfloat16-rounded gradients
    assert rounded != exact
