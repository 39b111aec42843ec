"""``--remat offload``: each block's input, the one activation ``full`` keeps per layer,
moved to host memory in the forward pass and brought back for the backward; the same
training to the last bit as ``full`` under every layout, the move read from the traced
step, and pp's tick schedules, which keep residuals in their own device buffers, refusing
it in one line (their ``auto`` runs GPipe instead)."""

import functools
import itertools

import jax
import pytest
from helpers import said

import shardplug
from shardplug.cli import main
from shardplug.core.memory import host_values
from shardplug.errors import ConfigError

STEPS = 2
LAYERS = 2
# strategy, mesh, devices, options
RUNS = {
    "fsdp": ("fsdp=2", 2, {"min_size": 0}),
    "fsdp+tp": ("fsdp=2,model=2", 4, {"min_size": 0}),
    "cp": ("context=2", 2, {}),
    "pp": ("stage=2", 2, {"schedule": "gpipe"}),
}


@functools.cache
def task(framework, remat):
    return shardplug.get_model("transformer").task(framework, layers=LAYERS, remat=remat)


def trainer(strategy, framework, remat):
    mesh, devices, options = RUNS[strategy]
    return task(framework, remat).trainer(
        strategy=shardplug.get_strategy(strategy, **options), mesh=mesh, devices=devices,
        precision="float32",
    )  # fmt: skip


@functools.cache
def run(strategy, framework, remat):
    made = trainer(strategy, framework, remat)
    data = itertools.islice(task(framework, remat).batches(), STEPS)
    made.fit(data, STEPS)
    return [r["loss"] for r in made.history], host_values(made.jaxpr)


PAIRS = [("fsdp", "nnx"), ("fsdp+tp", "nnx"), ("cp", "nnx"), ("pp", "nnx"), ("fsdp", "linen"),
         ("fsdp", "equinox")]  # fmt: skip


@pytest.mark.parametrize(("strategy", "framework"), PAIRS)
def test_offloaded_activations_train_as_full_remat(strategy, framework):
    want, kept = run(strategy, framework, "full")
    got, moved = run(strategy, framework, "offload")
    assert got == want  # the same arithmetic, to the last bit
    assert kept == []
    # the scan stacks each layer's input in host memory: (layers, rows, sequence, width);
    # a pipeline's stage stacks its own layers' inputs for one microbatch's rows
    per_stage = LAYERS // 2 if strategy == "pp" else LAYERS
    (stacked,) = [a for a in moved if a.ndim == 4 and a.shape[0] == per_stage]
    batch = next(iter(task(framework, "full").batches()))
    rows, sequence = jax.tree.leaves(batch)[0].shape[:2]
    assert stacked.shape[2] == sequence
    assert stacked.shape[1] == rows if strategy != "pp" else stacked.shape[1] < rows


def test_pp_tick_schedules_refuse_offload_and_auto_runs_gpipe(capsys):
    made = task("nnx", "offload").trainer(
        strategy=shardplug.get_strategy("pp", schedule="zb"), mesh="stage=2", devices=2,
        precision="float32",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"host memory \(--remat offload\): use -o pp.schedule"):
        made.fit(itertools.islice(task("nnx", "offload").batches(), 1), 1)
    capsys.readouterr()
    assert main(["train", "--strategy", "pp", "--devices", "2", "--steps", "1", "--remat",
                 "offload"]) == 0  # fmt: skip
    err = said(capsys.readouterr().err)
    assert err[0].startswith("shardplug: warning: pp runs gpipe, not its default"), err
    assert err[0].endswith("moves them to host memory (--remat offload)"), err


def test_explain_says_the_cpu_counts_offloaded_activations(capsys):
    assert main(["explain", "--strategy", "fsdp", "--devices", "2", "--remat", "offload"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "moves activations it saves for the backward pass to host memory" in out
