"""The step compiled for a GPU that is not here (``explain --target``): with JAX's CUDA
plugin (CI installs it for this file alone, after the rest), the GPU compiler's program and
memory; without it, one line saying what to install."""

import importlib.util

import jax
import optax
import pytest

import shardplug
from shardplug.cli import main
from shardplug.core.targets import TARGETS, find_target, target_devices
from shardplug.errors import ConfigError
from shardplug.explain import explain

PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="JAX's CUDA plugin is not installed")
# which attention a GPU's program runs is said as a warning (and checked in a note below)
pytestmark = pytest.mark.filterwarnings("ignore:shardplug.attention")


def test_an_unknown_gpu_or_count_is_one_line(capsys):
    with pytest.raises(ConfigError, match=r"--target h900: not a GPU .* h100, h200, a100"):
        find_target("h900")
    assert main(["explain", "--target", "h900"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("shardplug: error: --target h900")
    with pytest.raises(ConfigError, match="multiple of 8"):
        target_devices("h100", 12)


@pytest.mark.skipif(PLUGIN, reason="JAX's CUDA plugin is installed")
def test_without_the_plugin_it_says_what_to_install(capsys):
    assert main(["explain", "--target", "h100", "--model", "mlp"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "needs JAX's CUDA plugin" in line and "pip install 'shardplug[target]'" in line


def _trainer(strategy, count, **kwargs):
    model = shardplug.get_model("transformer")
    return model, shardplug.Trainer(
        model.adapter("nnx", layers=2), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3),
        strategy=strategy, devices=target_devices("h100", count), allocate=False,
        precision="bfloat16", **kwargs,
    )  # fmt: skip


@needs_plugin
def test_the_step_is_the_gpu_compilers_program_and_memory():
    model, trainer = _trainer("fsdp", 2)
    report = explain(trainer, next(model.batches(8, 0)))
    assert {d.device_kind for d in trainer.mesh.devices.flat} == {TARGETS["h100"].kind}
    analysis = trainer.compiled.memory_analysis()
    mem = report.per_device
    a = analysis
    held = a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
    assert mem["peak_bytes"] == held + a.temp_size_in_bytes
    assert mem["device_memory_bytes"] == TARGETS["h100"].memory_bytes
    text = trainer.compiled.as_text()
    assert "is_scheduled=true" in text and "all-gather" in text and "__triton" in text  # a GPU's
    assert report.notes[0].startswith("compiled for 2 x NVIDIA H100 80GB HBM3, not present")
    # float32 master weights, computed in bfloat16 (the GPU's default precision)
    assert jax.tree.leaves(trainer.state.params)[0].dtype.name == "float32"


@needs_plugin
def test_what_a_compile_only_gpu_cannot_hold_is_refused_in_one_line():
    model, trainer = _trainer(shardplug.get_strategy("fsdp", addons=["offload"]), 2)
    with pytest.raises(ConfigError, match="no host memory to compile offload's") as caught:
        explain(trainer, next(model.batches(8, 0)))
    assert "\n" not in str(caught.value)


@needs_plugin
def test_the_command_line_explains_for_a_named_gpu(capsys):
    assert main(["explain", "--target", "h100", "--devices", "2", "--strategy", "fsdp",
                 "--model", "mlp", "--json"]) == 0  # fmt: skip
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["per_device"]["device_memory_bytes"] == TARGETS["h100"].memory_bytes
    assert any(n.startswith("compiled for 2 x NVIDIA H100") for n in report["notes"])
