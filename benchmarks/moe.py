"""Expert parallelism against the same mixture of experts replicated under data parallelism.

The reference transformer with ``--experts`` (default 8) experts of top-``--top-k`` (2) MLPs
on ``--devices`` (8) simulated CPU devices, once under ``dp`` (every device holds every
expert) and once under ``ep`` (``expert`` = devices: each holds one): per-device parameter,
optimizer-state and peak bytes of the compiled step (nothing allocated), and step times in
interleaved rounds through ``shardplug.planning.bench`` (which also times each against its
hand-written twin, ``jax.jit`` with the same shardings and the same exchange, and checks the
losses equal); ep's compiled collectives are compared with its twin's. Ratios ep / dp.

Measured (8 CPU devices, 8 experts, top-2, 2 layers), ep / dp. Dropless: parameters and
Adam state 0.194 per device (the experts 1/8, the rest whole), temporaries 2.50, peak 1.79,
step time 1.75: each device's all-to-all slots hold all its assignments (any could go to one
device: 8x the routed tokens, 4.19 MB a step) and the grouped product computes over them.
Capacity 1.0 counted per device (``capacity_groups`` = 8): parameters and Adam state 0.194,
temporaries 0.42, peak 0.35, step time 0.31, the all-to-alls 524 kB a step: the textbook's
2 layers x 4 exchanges x 128 tokens x 2 x 64 x 4 B. In both, shardplug / hand-written 0.99
to 1.01 and equal losses; ep's all-to-alls are its twin's, its all-reduces 64 bytes more
(the rows' expert load and dropped share, which the twin does not compute). dp here is the
per-device program over the batch (each device sorts its own rows); before it, the
compiler's partitioning of one sort over the whole batch took dp 6x as long.

Run ``python benchmarks/moe.py`` (a few minutes on 2 cores); ``--json`` prints the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def measure(devices: int, options: dict, steps: int, rounds: int) -> dict:
    import shardplug
    from shardplug.core.compiled.hlo import collectives
    from shardplug.planning.bench import bench, hand_written
    from shardplug.planning.explain import explain

    model = shardplug.get_model("transformer")
    batch = next(model.batches(model.batch_size, 0))
    memory = {}
    for name in ("dp", "ep"):
        trainer = model.task("nnx", **options).trainer(strategy=name, allocate=False)
        memory[name] = explain(trainer, batch).per_device
    trainer = model.task("nnx", **options).trainer(strategy="ep")
    trainer.compile(batch)
    mine = collectives(trainer.compiled.as_text())
    twin = collectives(hand_written(trainer, model.task("nnx", **options), batch).as_text())
    timed = bench(["dp", "ep"], model_options=options, devices=devices, steps=steps, rounds=rounds)
    step = {r["strategy"]: r["median_step_seconds"] for r in timed["results"]
            if r["kind"] == "shardplug"}  # fmt: skip
    keys = ("params_bytes", "opt_state_bytes", "temp_bytes", "peak_bytes")
    return {
        "memory": {name: {k: row[k] for k in keys} for name, row in memory.items()},
        "memory_ep_over_dp": {k: memory["ep"][k] / memory["dp"][k] for k in keys},
        "step_seconds": step,
        "step_ep_over_dp": step["ep"] / step["dp"],
        "over_hand_written": timed["ratios"],
        "max_loss_diff": timed["max_loss_diff"],
        # the trainer's rows reduce the router's statistics, which the twin leaves unused
        "collectives_equal_twin_but_rows": [c for c in mine if c.kind != "all-reduce"]
        == [c for c in twin if c.kind != "all-reduce"],
        "all_reduce_bytes_beyond_twin": sum(c.bytes for c in mine if c.kind == "all-reduce")
        - sum(c.bytes for c in twin if c.kind == "all-reduce"),
        "ep_collectives": [dataclasses.asdict(c) for c in mine],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import shardplug

    shardplug.simulate_cpu_devices(args.devices)
    base = {"experts": args.experts, "top_k": args.top_k}
    # dropless (ep's slots hold every assignment a device has), and capacity counted per
    # device at F = 1 (slots of exactly a device's even share: the textbook's bytes)
    settings = {"dropless": base,
                "capacity 1.0 per device": {**base, "capacity_factor": 1.0,
                                            "capacity_groups": args.devices}}  # fmt: skip
    results = {k: measure(args.devices, o, args.steps, args.rounds) for k, o in settings.items()}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for setting, result in results.items():
        print(f"--- {setting}")
        show(result)


def show(result: dict) -> None:
    for name, row in result["memory"].items():
        print(f"{name}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in row.items()))
    print("ep / dp memory: " + ", ".join(
        f"{k} {v:.3f}" for k, v in result["memory_ep_over_dp"].items()))  # fmt: skip
    print(
        f"step: dp {result['step_seconds']['dp'] * 1e3:.1f} ms, ep "
        f"{result['step_seconds']['ep'] * 1e3:.1f} ms, ep / dp {result['step_ep_over_dp']:.2f}"
    )
    print(
        f"shardplug / hand-written: {result['over_hand_written']}; losses within "
        f"{result['max_loss_diff']}; ep's collectives equal its twin's: "
        f"{result['collectives_equal_twin_but_rows']} (the rows' statistics aside: "
        f"{result['all_reduce_bytes_beyond_twin']} bytes of all-reduce)"
    )
    print(f"ep collectives: {result['ep_collectives']}")


if __name__ == "__main__":
    main()
