"""The benchmark scripts run: the GPU one on a tiny model, so it is ready when a GPU is."""

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_mfu_script_runs_its_smoke_size(capsys):
    result = load("gpu_mfu").main(["--size", "smoke", "--steps", "2"])
    assert result["params"] > 0 and result["tokens_per_second"] > 0
    assert np.isfinite(result["loss"]) and result["precision"] == "bf16"
    assert result["mfu"] is None  # no dense bf16 peak is known for a CPU
    assert '"tokens_per_second"' in capsys.readouterr().out
    from shardplug.flops import TransformerShape

    assert (
        result["model_flops_per_token"]
        == TransformerShape(2, 64, 64, 512).flops_per_token()["total"]
    )
    assert result["hardware_tflops_per_second"] > 0  # the compiled step's own count


def test_host_cost_script_times_both_loops():
    times = load("host_cost")._loops(steps=30, log_every=10, rounds=1)
    assert all(times[k] > 0 for k in ("by hand", "by hand, flat", "shardplug"))


def test_the_hand_written_gpipe_takes_pp_s_step():
    """benchmarks/pipeline.py's baseline does the same work as pp: the same first loss."""
    import optax

    import shardplug

    bench = load("pipeline")
    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter("nnx", layers=4),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=shardplug.get_strategy("pp", microbatches=8),
        devices=4,
    )
    batch = next(model.batches(32, 0))
    trainer.compile(batch)
    hand = bench.hand_gpipe_step(trainer, model, batch, 8)
    ours = trainer.fit([batch], 1)[0]["loss"]
    np.testing.assert_allclose(hand, ours, rtol=1e-5)
