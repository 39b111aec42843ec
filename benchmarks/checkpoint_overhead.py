"""What asynchronous checkpointing costs a training loop, measured side by side.

Trains the reference transformer twice, interleaved in one process: without checkpoints, and
saving every K steps. Reports the median step time of each, the time ``save()`` blocks the
loop (fingerprints, and Orbax's copy to host memory), and how long the background write takes
to finish. Run: ``python benchmarks/checkpoint_overhead.py [--steps 60 --every 10]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from shardplug.core.devices import simulate_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    simulate_cpu_devices(args.devices)

    import jax
    import optax

    import shardplug

    model = shardplug.get_model(args.model)

    def trainer(folder):
        return shardplug.Trainer(
            model.adapter("nnx"),
            loss_fn=model.loss_fn,
            optimizer=optax.adam(model.learning_rate),
            strategy=args.strategy,
            devices=args.devices,
            log_every=1,
            checkpoint_dir=folder,
            checkpoint_every=args.every if folder else None,
        )

    times: dict[str, list[float]] = {"plain": [], "checkpointing": []}
    blocking, writing = [], []
    for _ in range(args.rounds):
        for kind in times:
            with tempfile.TemporaryDirectory() as folder:
                t = trainer(folder if kind == "checkpointing" else None)
                data = model.batches(model.batch_size, 0)
                t.compile(next(model.batches(model.batch_size, 0)))
                rows = t.fit(data, args.steps)
                times[kind] += [r["step_time"] for r in rows[1:]]
                if kind == "checkpointing":  # one more save, timed on its own
                    t.checkpoints.wait()
                    begin = time.perf_counter()
                    t.checkpoints.save(10**6, t.state, {})
                    blocking.append(time.perf_counter() - begin)
                    t.checkpoints.wait()
                    writing.append(time.perf_counter() - begin)
    plain = statistics.median(times["plain"])
    saving = statistics.median(times["checkpointing"])
    params = sum(x.size for x in jax.tree.leaves(t.state.params))
    result = {
        "model": args.model,
        "strategy": args.strategy,
        "devices": args.devices,
        "parameters": params,
        "checkpoint_every": args.every,
        "median_step_ms_plain": 1000 * plain,
        "median_step_ms_checkpointing": 1000 * saving,
        "ratio": saving / plain,
        "save_blocks_ms": 1000 * statistics.median(blocking),
        "save_completes_ms": 1000 * statistics.median(writing),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:30} {value:.3f}" if isinstance(value, float) else f"{key:30} {value}")


if __name__ == "__main__":
    main()
