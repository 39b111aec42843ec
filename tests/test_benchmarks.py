"""The benchmark scripts run: the GPU one on a tiny model, so it is ready when a GPU is."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses ask
    spec.loader.exec_module(module)
    return module


def test_gpu_mfu_script_runs_its_smoke_size(capsys):
    """shardplug through the user's path against the hand-written loop, interleaved; the
    FLOP counts agree (hardware >= model), both compute in bfloat16, a peak is predicted."""
    result = load("gpu_mfu").main(["--size", "smoke", "--steps", "2", "--rounds", "2"])
    assert result["params"] > 0 and np.isfinite(result["loss"]) and result["precision"] == "bf16"
    assert '"ratio"' in capsys.readouterr().out
    from shardplug.core.flops import TransformerShape

    assert (
        result["model_flops_per_token"]
        == TransformerShape(2, 64, 64, 512).flops_per_token()["total"]
    )
    for side in ("shardplug", "hand_written"):
        figures = result[side]
        assert figures["mfu"] is None  # no dense bf16 peak is known for a CPU
        assert figures["hardware_tflops_per_second"] >= figures["model_tflops_per_second"] > 0
        assert figures["bf16_share"] >= 0.9
        assert len(result["rounds"][side]) == 2
    assert (
        result["ratio"]
        == result["shardplug"]["step_seconds"] / result["hand_written"]["step_seconds"]
    )
    assert result["predicted_peak_bytes"] > 0 and result["measured_peak_bytes"] is None  # CPU


def test_gpu_mfu_plans_the_largest_size_that_fits():
    result = load("gpu_mfu").main(
        ["--plan", "--sizes", "smoke,125m", "--batch", "2", "--device-memory", "1e9"]
    )
    smoke, gpt = result["plan"]
    assert smoke["fits"] and not gpt["fits"] and result["largest_that_fits"] == "smoke"
    assert gpt["params"] == 163_026_432  # GPT-3 125M with a 50,304 vocabulary, untied


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
        strategy=shardplug.get_strategy("pp", microbatches=8, schedule="gpipe"),
        devices=4,
    )
    batch = next(model.batches(32, 0))
    trainer.compile(batch)
    hand = bench.hand_gpipe_step(trainer, model, batch, 8)
    ours = trainer.fit([batch], 1)[0]["loss"]
    np.testing.assert_allclose(hand, ours, rtol=1e-5)


def test_cp_attention_times_the_short_and_plans_the_long():
    """8 devices, where the 4 heads do not divide them: the hybrid instead of Ulysses; the
    timed length asserts every scheme's loss is the gather's, the longer one is compiled only."""
    result = load("cp_attention").measure([32, 64], devices=8, steps=1, rounds=1, timed_up_to=32)
    assert set(result[32]) == {"gather", "ring", "ring+zigzag", "hybrid"}
    assert result[32]["hybrid"]["groups"] == 4
    assert all(r["step_s"] > 0 and r["sent_bytes"] > 0 for r in result[32].values())
    assert all("step_s" not in r and r["temp_bytes"] > 0 for r in result[64].values())
    assert result[64]["hybrid"]["collectives"]["all-to-all"]["count"] > 0


def test_packing_counts_more_real_tokens_in_rows_of_the_same_shape():
    result = load("packing").main(["--sequence", "64", "--median", "12", "--rows", "2",
                                   "--steps", "1", "--rounds", "1", "--json"])  # fmt: skip
    packed, padded = result["packed"], result["padded"]
    assert packed["targets_per_step"] > 2 * padded["targets_per_step"] > 0
    assert result["packed_over_padded"]["tokens_per_s"] == pytest.approx(
        packed["tokens_per_s"] / padded["tokens_per_s"])  # fmt: skip


@pytest.mark.slow
def test_the_gpu_check_script_runs_every_offload_lora_and_float8_mode_on_a_tiny_gpt(tmp_path):
    """benchmarks/gpu/check.sh, ready for a GPU: every mode trains and writes its JSON."""
    import json
    import os
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path), "SIZE": "smoke", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(rows) == 11 and rows["h100_smoke-offload"]["addons"] == ["offload"]
    assert rows["h100_smoke-remat-offload"]["remat"] == "offload"
    assert rows["h100_smoke-float8-row"]["options"] == ["float8.scaling=row"]
    assert rows["h100_smoke-qlora16-nf4"]["lora_quantize"] == "nf4"
    assert rows["h100_smoke-offload-params"]["options"] == ["offload.params=true"]
    assert all(np.isfinite(r["loss"]) for r in rows.values())
