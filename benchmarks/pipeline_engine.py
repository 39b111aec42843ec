"""What running a pipeline schedule costs one device: pp on ``stage=1`` against the same
microbatches accumulated by core.

With one stage a schedule has no bubble and sends nothing, so what is left is the engine:
GPipe's stage loop, or for the schedules that write the backward pass in (1F1B, ZB-H1) the
tick loop, each layer's pullback cut into its input half (B) and weight half (W), and the
slots the residuals wait in. The reference is ``dp`` with ``grad_accum=M``: the same M
microbatches one after another under autodiff. Each contender is timed in interleaved rounds
(medians; the rounds' range of the ratio is the noise), and its compiled step's temporaries
are read from the memory analysis (nothing allocated for it).

``python benchmarks/pipeline_engine.py --size 1b`` is meant for a GPU (bfloat16 compute, a
Llama-shaped decoder from ``examples/tasks/llama.py``: 16 layers of width 2048, sequence
1024); ``--size smoke`` runs anywhere. It prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import pathlib
import statistics
import sys
import time
from typing import Any

#: the tick engine's version a record measured: 2 since each layer's residuals are written
#: straight into their slot (records without it measured the engine before)
ENGINE = 2

SIZES = {
    "smoke": {"layers": 4, "width": 64, "heads": 4, "mlp": 128, "vocab": 256, "sequence": 32},
    "350m": {
        "layers": 24,
        "width": 1024,
        "heads": 16,
        "mlp": 2816,
        "vocab": 32000,
        "sequence": 1024,
    },
    "1b": {"layers": 16, "width": 2048, "heads": 16, "mlp": 5632, "vocab": 32000, "sequence": 1024},
}


def llama_example() -> Any:
    path = pathlib.Path(__file__).parent.parent / "examples" / "tasks" / "llama.py"
    spec = importlib.util.spec_from_file_location("llama_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def contenders(microbatches: int) -> dict[str, dict[str, Any]]:
    """Each contender's strategy and trainer options."""
    m = microbatches
    return {
        "dp, grad_accum=M": {"strategy": "dp", "grad_accum": m},
        "pp gpipe (remat)": {"strategy": ("pp", {"microbatches": m, "schedule": "gpipe"})},
        "pp gpipe (no remat)": {
            "strategy": ("pp", {"microbatches": m, "schedule": "gpipe", "remat": False})
        },
        "pp 1f1b": {"strategy": ("pp", {"microbatches": m, "schedule": "1f1b"})},
        "pp zb": {"strategy": ("pp", {"microbatches": m, "schedule": "zb"})},
    }


def run(size: str, batch: int, microbatches: int, rounds: int, steps: int,
        precision: str | None) -> dict[str, Any]:  # fmt: skip
    import jax

    import shardplug

    llama = llama_example()
    config = dataclasses.replace(llama.Config(), **SIZES[size], batch=batch, remat="none")
    task = llama.task_of(config, f"llama-{size}")
    data = list(itertools.islice(task.batches(), 2))
    trainers, times, temp, skipped = {}, {}, {}, {}
    for name, how in contenders(microbatches).items():
        strategy = how["strategy"]
        if isinstance(strategy, tuple):
            strategy = shardplug.get_strategy(strategy[0], **strategy[1])
        trainer = task.trainer(
            strategy=strategy, devices=1, mesh="stage=1" if "pp" in name else None,
            grad_accum=how.get("grad_accum", 1), precision=precision or "auto", log_every=10_000,
        )  # fmt: skip
        try:
            trainer.fit(itertools.islice(itertools.cycle(data), 2), 2)  # compile, warm up
        except Exception as exc:  # out of memory: said, and the rest still measured
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        temp[name] = int(trainer.compiled.memory_analysis().temp_size_in_bytes)
        trainers[name], times[name] = trainer, []
    for r in range(rounds):
        order = list(trainers) if r % 2 == 0 else list(trainers)[::-1]
        for name in order:
            start = time.perf_counter()
            rows = trainers[name].fit(itertools.islice(itertools.cycle(data), steps), steps)
            jax.block_until_ready(rows[-1]["loss"])
            times[name].append((time.perf_counter() - start) / steps)
    base = "dp, grad_accum=M"
    out = {}
    for name in trainers:
        ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
        out[name] = {
            "step_ms": 1e3 * statistics.median(times[name]),
            "vs_accumulation": statistics.median(ratios),
            "range": [min(ratios), max(ratios)],
            "temp_bytes": temp[name],
        }
    device = jax.devices()[0]
    return {
        "device": getattr(device, "device_kind", device.platform), "engine": ENGINE,
        "size": size, "params": SIZES[size], "batch": batch, "microbatches": microbatches,
        "precision": trainers[base].precision, "rounds": rounds, "steps": steps,
        "contenders": out, "skipped": skipped,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="smoke")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default=None, help="default: the device's (auto)")
    args = parser.parse_args(argv)
    result = run(args.size, args.batch, args.microbatches, args.rounds, args.steps,
                 args.precision)  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
