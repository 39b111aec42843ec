"""Performance, measured: what each strategy holds and sends, how fast it runs next to
hand-written JAX, and what gradient accumulation and bfloat16 do to the numbers.

Run ``python benchmarks/performance.py`` (8 simulated CPU devices, a few minutes on 2
cores). It writes ``benchmarks/results.md`` (quoted by the README) and
``benchmarks/results.json``; ``--out DIR`` writes them elsewhere.

1. ``explain`` of dp, fsdp, 2d, pmap and the compositions on the transformer: bytes per
   device from the compiled step, and the collectives against the textbook.
2. ``bench``: interleaved rounds of every strategy, its hand-written twin, Flax's nnx.jit
   loop and one device; the overhead ratio is the median of the rounds' paired ratios.
3. Gradient accumulation: 4 microbatches against the 4x batch, every strategy.
4. bfloat16 against float32 after 200 steps.
5. The host cost per step (``benchmarks/host_cost.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import host_cost

from shardplug.core.devices import simulate_cpu_devices

STRATEGIES = ("dp", "fsdp", "2d", "pmap", "dp+fsdp", "fsdp+tp", "dp+fsdp+tp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    import optax

    import shardplug
    from shardplug.planning.bench import bench
    from shardplug.planning.explain import explain
    from shardplug.planning.views import size

    model = shardplug.get_model("transformer")

    def trainer(strategy, **kwargs):
        return shardplug.Trainer(
            model.adapter("nnx"),
            loss_fn=model.loss_fn,
            optimizer=optax.adam(model.learning_rate),
            strategy=strategy,
            **kwargs,
        )

    results: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {jax.devices()[0].platform}, "
        f"{args.devices} simulated devices",
        "jax": jax.__version__,
    }
    lines = [
        "# shardplug performance, measured",
        "",
        f"`python benchmarks/performance.py` on {results['date']}: {results['machine']}, "
        f"jax {jax.__version__}. The reference transformer (nnx), batch {model.batch_size}.",
        "",
        "## Memory and communication per device (`shardplug explain`)",
        "",
        "| strategy | params | optimizer state | temporaries | peak | sent per step "
        "(compiled) | sent per step (textbook) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    explained = {}
    batch = next(model.batches(model.batch_size, 0))
    for strategy in STRATEGIES:
        print(f"explain {strategy}", flush=True)
        report = explain(trainer(strategy), batch)
        explained[strategy] = report.to_dict()
        d = report.per_device
        ratio = report.wire_bytes() / max(report.textbook_wire_bytes(), 1)
        lines.append(
            f"| {strategy} | {size(d['params_bytes'])} | {size(d['opt_state_bytes'])} | "
            f"{size(d['temp_bytes'])} | {size(d['peak_bytes'])} | {size(report.wire_bytes())} "
            f"| {size(report.textbook_wire_bytes())} | {ratio:.3f} |"
        )
    dp = explained["dp"]["per_device"]

    def over_dp_share(strategy):
        held = explained[strategy]["per_device"]
        return {k: held[k] / (dp[k] / args.devices) for k in ("params_bytes", "opt_state_bytes")}

    memory, both = over_dp_share("fsdp"), over_dp_share("fsdp+tp")
    results["explain"] = explained
    results["fsdp_over_dp_eighth"] = memory
    results["fsdp_tp_over_dp_eighth"] = both
    lines += [
        "",
        f"fsdp holds {memory['params_bytes']:.3f}x dp's parameter bytes / {args.devices} and "
        f"{memory['opt_state_bytes']:.3f}x its optimizer-state bytes / {args.devices}: the "
        "norms' scales and biases (64 elements each) stay whole on every device. fsdp+tp "
        f"(fsdp=4, model=2) holds {both['params_bytes']:.3f}x and "
        f"{both['opt_state_bytes']:.3f}x: what tp leaves whole, fsdp stores over `model` too.",
        "",
        "Sent bytes are per device per step with ring algorithms. dp's compiled program is "
        "the textbook's one all-reduce of the gradients (plus the 4-byte loss). fsdp's "
        "gathers the layer stack one layer at a time in the forward scan and again in the "
        "backward one (the textbook's 2 all-gathers), the embeddings and head once for both, "
        "and all-reduces the gradients where the textbook reduce-scatters them (XLA's CPU "
        "backend: each device then keeps its shard), which sends twice a reduce-scatter's "
        "bytes: the excess over the textbook. 2d's textbook counts only the gradient "
        "all-reduce over `data`; tensor parallelism's activation all-reduces over `model` "
        "come on top.",
    ]

    print("bench", flush=True)
    report = bench(STRATEGIES, "transformer", "nnx", args.devices, args.steps, args.rounds)
    results["bench"] = report
    lines += [
        "",
        f"## Speed (`shardplug bench`): median of {args.rounds} interleaved rounds of "
        f"{args.steps} steps",
        "",
        "| contender | compile s | step ms | tokens/s | shardplug / hand-written | speedup "
        "vs 1 device |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        mine = r["kind"] == "shardplug"
        lines.append(
            f"| {r['name']} | {r['compile_seconds']:.2f} | {1000 * r['median_step_seconds']:.2f}"
            f" | {r['tokens_per_second']:.0f} | "
            f"{format(report['ratios'][r['strategy']], '.3f') if mine else ''} | "
            f"{format(report['speedup'][r['strategy']], '.2f') if mine else ''} |"
        )
    lines += [
        "",
        f"shardplug's dp / the nnx.jit loop of Flax's documentation: "
        f"{report['nnx_jit_ratio']:.3f}. Losses equal the hand-written runs' within "
        f"{max(report['max_loss_diff'].values()):.1e}. The 8 devices are simulated on the "
        "same CPU cores, so more devices do not make a step faster here: the speedup column "
        "measures the cost of splitting, not a gain.",
    ]

    print("gradient accumulation", flush=True)
    accumulation = {}
    for strategy in STRATEGIES:
        losses = [
            np.array([r["loss"] for r in trainer(strategy, grad_accum=k, log_every=5).fit(
                model.batches(4 * model.batch_size, 0), 5)])
            for k in (1, 4)
        ]  # fmt: skip
        accumulation[strategy] = float(np.max(np.abs(losses[1] - losses[0]) / losses[0]))
    results["grad_accum_max_rel_diff"] = accumulation
    lines += [
        "",
        "## Gradient accumulation and bfloat16",
        "",
        f"4 microbatches of {model.batch_size} against one batch of {4 * model.batch_size}, 5 "
        "steps: largest relative loss difference "
        + ", ".join(f"{s} {v:.1e}" for s, v in accumulation.items())
        + ".",
    ]

    print("bf16", flush=True)
    final = {}
    for precision in ("float32", "bf16"):
        rows = trainer("dp", precision=precision, log_every=50).fit(
            model.batches(model.batch_size, 0), 200
        )
        final[precision] = float(np.mean([r["loss"] for r in rows[-10:]]))
    gap = abs(final["bf16"] - final["float32"]) / final["float32"]
    results["bf16_after_200_steps"] = {**final, "relative_gap": gap}
    lines += [
        "",
        f"After 200 steps (dp, mean loss of the last 10): float32 {final['float32']:.4f}, "
        f"bf16 {final['bf16']:.4f}: {gap:.2%} apart.",
        "",
    ]
    print("host cost", flush=True)
    results["host_cost"] = host_cost.measure()
    lines += [
        *host_cost.section(results["host_cost"]),
        "",
        "## GPU",
        "",
        "No GPU was lent to this measurement; `benchmarks/gpu_mfu.py` is ready for one (see "
        "the README).",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
