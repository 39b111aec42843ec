"""cp's two attention schemes side by side: keys and values all-gathered, or passed round the
ring.

The reference transformer (NNX) at ``--sequences`` (default 1024 and 4096), batch 4, under
``cp`` on ``--devices`` simulated CPU devices (context = devices), once with
``attention="gather"`` and once with ``attention="ring"``: each step compiled, its compiled
temporaries (``memory_analysis``), its collectives, and the median step time over
interleaved rounds, reported as ring / gather ratios. The same losses are asserted, so the
two compute the same thing. A GPU run records the attention function's kernel time instead
(one GPU has no ring); none was lent when this was written.

Run ``python benchmarks/cp_attention.py`` (a few minutes on 2 cores); ``--json`` prints the
figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(sequences: list[int], devices: int, steps: int, rounds: int) -> dict:
    import jax
    import numpy as np

    import shardplug
    from shardplug.core.hlo import collectives

    model = shardplug.get_model("transformer")
    out = {}
    for length in sequences:
        batch = next(model.batches(4, 0, sequence=length))
        trainers, rows = {}, {}
        for scheme in ("gather", "ring"):
            task = model.task("nnx", sequence=length, batch_size=4)
            trainer = task.trainer(
                strategy=shardplug.get_strategy("cp", attention=scheme), devices=devices
            )
            trainer.compile(batch)
            found = collectives(trainer.compiled.as_text())
            trainers[scheme] = trainer
            rows[scheme] = {
                "temp_bytes": trainer.compiled.memory_analysis().temp_size_in_bytes,
                "collectives": {c.kind: {"count": c.count, "bytes": c.bytes} for c in found},
                "times": [],
            }
        for _ in range(rounds):  # interleaved, so both see the same machine
            for scheme, trainer in trainers.items():
                start = time.perf_counter()
                history = trainer.fit([batch] * steps, steps=steps)
                jax.block_until_ready(trainer.state.params)
                rows[scheme]["times"].append((time.perf_counter() - start) / steps)
                rows[scheme]["loss"] = history[-1]["loss"]
        np.testing.assert_allclose(rows["ring"]["loss"], rows["gather"]["loss"], rtol=1e-4)
        for row in rows.values():
            row["step_s"] = statistics.median(row.pop("times"))
        out[length] = {
            **rows,
            "ring_over_gather": {
                "temp_bytes": rows["ring"]["temp_bytes"] / rows["gather"]["temp_bytes"],
                "step_s": rows["ring"]["step_s"] / rows["gather"]["step_s"],
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="1024,4096")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import shardplug

    shardplug.simulate_cpu_devices(args.devices)
    sequences = [int(s) for s in args.sequences.split(",")]
    result = measure(sequences, args.devices, args.steps, args.rounds)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for length, row in result.items():
        g, r = row["gather"], row["ring"]
        print(
            f"sequence {length}, context {args.devices}: gather {g['step_s'] * 1e3:.1f} ms/step, "
            f"{g['temp_bytes'] / 2**20:.1f} MiB temporaries; ring {r['step_s'] * 1e3:.1f} "
            f"ms/step, {r['temp_bytes'] / 2**20:.1f} MiB; ring/gather time "
            f"{row['ring_over_gather']['step_s']:.2f}, memory "
            f"{row['ring_over_gather']['temp_bytes']:.2f}"
        )
        for scheme in ("gather", "ring"):
            print(f"  {scheme} collectives: {row[scheme]['collectives']}")


if __name__ == "__main__":
    main()
