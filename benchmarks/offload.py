"""Offload, measured: what keeping the training state in host memory costs a step, and what it
frees on the devices.

The reference transformer (NNX, 8 layers) under ``fsdp`` on 2 simulated CPU devices, Adam,
in four forms side by side in one run (interleaved rounds, medians; the range of the rounds'
ratios is the noise): the state on the devices; ``offload`` (Adam's moments in host memory,
copied in for the update); ``offload update=host`` (the update computed on the host);
``offload params=true update=host`` (the master weights there too). Each is timed against its
twin written by hand in plain JAX (``jax.jit`` with the same shardings and memory kinds,
``jax.device_put`` to the devices where the state is used, the whole optimizer state at once
as MaxText does where shardplug brings it a parameter's at a time, and
``compute_on("device_host")`` for the host's update: ``shardplug.planning.bench.hand_written``), and
against the run without offload.
The compiled step's argument bytes per device, by memory, are read from its entry layout.

On CPU devices host memory is the devices' memory: the copies cost what a copy in RAM costs,
not a PCIe transfer, so the ratios here are shardplug's overhead against the twin and a floor
for offload's own cost; a GPU's figures need a GPU (benchmarks/gpu/).

Run ``python benchmarks/offload.py`` (about a minute on 2 cores): it prints the figures as
JSON and writes them as a table to ``benchmarks/offload.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

FORMS = {  # name: offload's options (None: no offload)
    "none": None,
    "offload": {},
    "offload update=host": {"update": "host"},
    "offload params=true update=host": {"params": True, "update": "host"},
}


def _timed(contenders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each contender is ``run() -> seconds per step``; rounds interleaved, every other one
    backwards."""
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for k in contenders:
        contenders[k]()  # warm up
    for r in range(rounds):
        for k in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
            times[k].append(contenders[k]())
    return times


def _ratio(times: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def measure(rounds: int, steps: int, layers: int = 8) -> dict[str, Any]:
    import jax

    import shardplug
    from shardplug.core.memory import entry_bytes
    from shardplug.planning.bench import hand_written

    model = shardplug.get_model("transformer")
    task = model.task("nnx", layers=layers)
    batches = list(itertools.islice(task.batches(), 4))
    runs, figures = {}, {}
    for name, options in FORMS.items():
        extra = {f"offload.{k}": v for k, v in (options or {}).items()}
        strategy = shardplug.get_strategy(
            "fsdp", addons=[] if options is None else ["offload"], min_size=0, **extra
        )
        trainer = task.trainer(strategy=strategy, devices=2, precision="float32", log_every=steps)
        trainer.compile(batches[0])
        twin = hand_written(trainer, model, batches[0])
        state = {
            "params": jax.tree.map(lambda x: x.copy(), trainer.state.params),
            "opt": jax.tree.map(lambda x: x.copy(), trainer.state.opt_state),
        }
        batch_sharding = trainer.batch_shardings

        def run_trainer(trainer=trainer):
            start = time.perf_counter()
            trainer.fit(itertools.islice(itertools.cycle(batches), steps), steps)
            return (time.perf_counter() - start) / steps

        def run_twin(twin=twin, state=state, sharding=batch_sharding):
            start = time.perf_counter()
            for batch in itertools.islice(itertools.cycle(batches), steps):
                batch = jax.device_put(batch, sharding)
                state["params"], state["opt"], loss = twin(state["params"], state["opt"], batch)
            jax.block_until_ready(loss)
            return (time.perf_counter() - start) / steps

        runs[name], runs[f"{name} by hand"] = run_trainer, run_twin
        args = entry_bytes(trainer.compiled.as_text())["arguments"]
        figures[name] = {"device_argument_bytes": args["device"], "host_bytes": args["host"]}
    times = _timed(runs, rounds)
    for name in FORMS:
        figures[name]["step_ms"] = 1e3 * statistics.median(times[name])
        figures[name]["/ hand-written"] = _ratio(times, name, f"{name} by hand")
        figures[name]["/ none"] = _ratio(times, name, "none")
    return figures


def markdown(report: dict[str, Any]) -> str:
    def ratio(r: dict[str, float]) -> str:
        return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"

    lines = [
        "# Offload, measured",
        "",
        f"`python benchmarks/offload.py`: {report['platform']}, 2 simulated CPU devices on "
        f"{report['cores']} cores, the reference transformer (NNX, {report['layers']} layers) "
        f"under `fsdp`, Adam, {report['rounds']} interleaved rounds of {report['steps']} steps "
        f"(median, and the range of the rounds' ratios: the noise).",
        "",
        "| form | device arguments | host | step ms | / hand-written | / none |",
        "|---|---|---|---|---|---|",
        *[
            f"| {k} | {v['device_argument_bytes'] / 1e6:.2f} MB | {v['host_bytes'] / 1e6:.2f} MB "
            f"| {v['step_ms']:.1f} | {ratio(v['/ hand-written'])} | {ratio(v['/ none'])} |"
            for k, v in report["forms"].items()
        ],
        "",
        "Host memory is the devices' memory on CPU devices: the copies here cost a copy in RAM, "
        "not a PCIe transfer. What the ratios to the hand-written twins show is shardplug's "
        "overhead (its update=device brings the optimizer state a parameter's at a time, the "
        "twin all at once); a GPU's cost of offload needs a GPU.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import os
    import platform

    from shardplug.core.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    report = {
        "platform": platform.machine(),
        "cores": os.cpu_count(),
        "layers": 8,
        "rounds": args.rounds,
        "steps": args.steps,
        "forms": measure(args.rounds, args.steps),
    }
    print(json.dumps(report, indent=1))
    (Path(__file__).parent / "offload.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
