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
