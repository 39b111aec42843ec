"""Pipeline parallelism and layer stacks, measured: what ``pp`` costs and what the stack saves.

Four measurements of the reference transformer on simulated CPU devices, each side by side
in one run (interleaved rounds, medians; the spread of the rounds' ratios is printed as the
noise):

1. **Efficiency trend**: ``pp`` on ``stage=S`` (8 layers) with M = S and M = 4S
   microbatches at the same global batch, against ``dp``: the bubble (S-1)/(M+S-1) falls.
2. **Against hand-written GPipe**: ``pp`` against a GPipe schedule written here in plain
   ``jax.shard_map`` with ``ppermute`` (the JAX shard_map notebook's form), the same model,
   optimizer, shardings, microbatches and per-stage rematerialisation; ratio of step times
   (target <= 1.05).
3. **Compile time in depth**: the training step at 4, 16 and 48 layers, the blocks as one
   stack (a scan) against the same blocks unrolled in a Python loop.
4. **Rematerialisation**: ``--remat none|dots|full`` on ``dp``: the compiled step's peak
   bytes per device and its step time, as ratios to ``none``.
5. **Schedules**: ``pp`` on ``stage=4`` (8 layers, microbatches of 4 rows) under each
   schedule: the bubble counted from the idle ticks of the table the compiled loop runs,
   against its formula; the compiled step's temporaries per device at M = 8, 16 and 32
   (explain, nothing allocated); and the step time at M = 8 in interleaved rounds, as a
   ratio to GPipe's. (Simulated stages share the cores: a stage's idle tick under the
   written-in schedules computes nothing and frees its core, so step times here favour them
   over GPipe, whose idle ticks compute and are masked; ``benchmarks/pipeline_engine.py``
   measures each engine on one real device.)

Run ``python benchmarks/pipeline.py`` (a few minutes on 2 cores): it prints the figures
as JSON and writes them as tables to ``benchmarks/pipeline.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _timed(contenders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each contender is ``run() -> seconds per step``; rounds interleaved, every other one
    backwards."""
    times: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for k in names:
        contenders[k]()  # warm up
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k].append(contenders[k]())
    return times


def _ratio(times, a, b) -> dict[str, float]:
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _trainer(strategy, layers, devices, mesh=None, remat=None, **options):
    import optax

    import shardplug

    model = shardplug.get_model("transformer")
    return model, shardplug.Trainer(
        model.adapter("nnx", layers=layers, remat=remat),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=shardplug.get_strategy(strategy, **options),
        devices=devices,
        mesh=mesh,
        log_every=1000,
    )


def _fit_runner(trainer, batches, steps):
    import itertools

    trainer.compile(batches[0])

    def run():
        start = time.perf_counter()
        trainer.fit(itertools.islice(itertools.cycle(batches), steps), steps)
        return (time.perf_counter() - start) / steps

    return run


def hand_gpipe(trainer, model, batch, microbatches: int):
    """The trainer's step as a plain GPipe: embeddings and head under ``jax.jit``, the
    stack in ``jax.shard_map`` over ``stage`` (stage-local scan, ``ppermute`` each tick,
    the last stage's outputs summed to all), ``jax.checkpoint`` per stage and tick."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, optimizer = trainer.mesh, trainer.optimizer
    shardings = trainer.state_shardings
    stages = mesh.shape["stage"]
    graphdef = trainer.adapter.graphdef
    rest = trainer.state.model_state

    def stack_forward(blocks, x):
        gd, params = nnx.split(blocks)

        def stage(local, xs):
            i = jax.lax.axis_index("stage")

            def layers(ws, h):
                return jax.lax.scan(lambda h, w: (nnx.merge(gd, w)(h), None), h, ws)[0]

            layers = jax.checkpoint(layers)
            out = jax.lax.pcast(jnp.zeros_like(xs), ("stage",), to="varying")
            state = jax.lax.pcast(jnp.zeros_like(xs[0]), ("stage",), to="varying")

            def tick(carry, t):
                state, out = carry
                h = jnp.where(i == 0, xs[jnp.clip(t, 0, microbatches - 1)], state)
                y = layers(local, h)
                k = t - (stages - 1)
                out = jnp.where((i == stages - 1) & (k >= 0), out.at[jnp.maximum(k, 0)].set(y),
                                out)  # fmt: skip
                perm = [(j, (j + 1) % stages) for j in range(stages)]
                return (jax.lax.ppermute(y, "stage", perm), out), None

            ticks = jnp.arange(microbatches + stages - 1)
            (_, out), _ = jax.lax.scan(tick, (state, out), ticks)
            return jax.lax.psum(jnp.where(i == stages - 1, out, 0.0), "stage")

        b = x.shape[0]
        xs = x.reshape(b // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        specs = jax.tree.map(lambda _: P("stage"), params)
        ys = jax.shard_map(stage, in_specs=(specs, P()), out_specs=P(),
                           axis_names={"stage"})(params, xs)  # fmt: skip
        return ys.swapaxes(0, 1).reshape(x.shape)

    def loss(params, batch):
        m = nnx.merge(graphdef, params, rest)
        tokens = batch["tokens"]
        x = m.embed[...][tokens] + m.position[...][None, : tokens.shape[1]]
        logits = m.norm(stack_forward(m.blocks, x)) @ m.unembed[...]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    batch_sharding = jax.tree.map(lambda s: s, trainer.batch_shardings)
    jitted = jax.jit(
        step,
        in_shardings=(shardings.params, shardings.opt_state, batch_sharding),
        out_shardings=(shardings.params, shardings.opt_state, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    with jax.set_mesh(mesh):
        compiled = jitted.lower(trainer.state.params, trainer.state.opt_state, batch).compile()
    state = {
        "params": jax.tree.map(lambda x: x.copy(), trainer.state.params),
        "opt": jax.tree.map(lambda x: x.copy(), trainer.state.opt_state),
    }
    return compiled, state, batch_sharding


def efficiency(rounds: int, steps: int, batch: int = 128) -> dict[str, Any]:
    import jax

    model, dp = _trainer("dp", 8, 8)
    batches = list(__import__("itertools").islice(model.batches(batch, 0), 4))
    runs = {"dp": _fit_runner(dp, batches, steps)}
    pps = {}
    for m in (8, 32):
        _, pps[m] = _trainer("pp", 8, 8, microbatches=m, schedule="gpipe")
        runs[f"pp M={m}"] = _fit_runner(pps[m], batches, steps)
    # hand-written GPipe with M = 32, same shardings as pp's
    compiled, state, sharding = hand_gpipe(pps[32], model, batches[0], 32)

    def hand():
        start = time.perf_counter()
        values = []
        for i in range(steps):
            b = jax.device_put(batches[i % len(batches)], sharding)
            state["params"], state["opt"], v = compiled(state["params"], state["opt"], b)
            values.append(v)
        jax.block_until_ready(values)
        return (time.perf_counter() - start) / steps

    runs["hand GPipe M=32"] = hand
    times = _timed(runs, rounds)
    return {
        "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "pp M=8 / dp": _ratio(times, "pp M=8", "dp"),
        "pp M=32 / dp": _ratio(times, "pp M=32", "dp"),
        "pp M=32 / hand GPipe": _ratio(times, "pp M=32", "hand GPipe M=32"),
        "bubble": {"M=8": 7 / 15, "M=32": 7 / 39},
    }


def compile_depth(depths=(4, 16, 48)) -> dict[str, Any]:
    import jax
    import optax

    import shardplug

    model = shardplug.get_model("transformer")
    batch = next(model.batches(8, 0))
    key = jax.random.key(0)
    out = {}
    for layers in depths:
        adapter = model.adapter("nnx", layers=layers)
        params, rest = adapter.init(jax.random.key(0))

        def stacked(p, adapter=adapter, rest=rest):
            return model.loss_fn(adapter.bind(p, rest, rng=key, train=True), batch)[0]

        def unrolled(p, adapter=adapter, rest=rest, layers=layers):
            from flax import nnx

            m = adapter.bind(p, rest, rng=key, train=True)
            gd, blocks = nnx.split(m.blocks)
            tokens = batch["tokens"]
            x = m.embed[...][tokens] + m.position[...][None, : tokens.shape[1]]
            for i in range(layers):
                x = nnx.merge(gd, jax.tree.map(lambda w, i=i: w[i], blocks))(x)
            logits = m.norm(x) @ m.unembed[...]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        row = {}
        for name, fn in (("stacked", stacked), ("unrolled", unrolled)):
            start = time.perf_counter()
            jax.jit(jax.value_and_grad(fn)).lower(params).compile()
            row[name] = time.perf_counter() - start
        out[layers] = row
    return out


def remat(rounds: int, steps: int) -> dict[str, Any]:
    model, _ = _trainer("dp", 8, 8)
    batches = list(__import__("itertools").islice(model.batches(32, 0), 4))
    runs, peaks = {}, {}
    for policy in ("none", "dots", "full"):
        _, trainer = _trainer("dp", 8, 8, remat=policy)
        runs[policy] = _fit_runner(trainer, batches, steps)
        analysis = trainer.compiled.memory_analysis()
        peaks[policy] = int(analysis.temp_size_in_bytes)
    times = _timed(runs, rounds)
    return {
        "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "temp_bytes": peaks,
        "time / none": {k: _ratio(times, k, "none") for k in ("dots", "full")},
        "temp / none": {k: peaks[k] / peaks["none"] for k in ("dots", "full")},
    }


SCHEDULE_ROWS = {  # name: pp options
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved-1f1b (V=2)": {"schedule": "interleaved-1f1b", "repeats": 2},
    "zb": {"schedule": "zb"},
    "zbv (V=2)": {"schedule": "zbv"},
}


def schedules(rounds: int, steps: int, rows: int = 4) -> dict[str, Any]:
    from shardplug.planning.explain import explain
    from shardplug.strategies.pp.stages import Pipeline

    model = __import__("shardplug").get_model("transformer")
    out: dict[str, Any] = {}
    runs = {}
    for name, options in SCHEDULE_ROWS.items():
        temps = {}
        for m in (8, 16, 32):
            _, trainer = _trainer("pp", 8, 4, mesh="stage=4", microbatches=m, **options)
            batch = next(model.batches(rows * m, 0))
            report = explain(trainer, batch)
            temps[m] = report.per_device["temp_bytes"]
            if m == 8:
                pl = report.pipeline
                batches = list(__import__("itertools").islice(model.batches(rows * m, 0), 4))
                runs[name] = _fit_runner(trainer, batches, steps)
        v = options.get("repeats", 1)
        formula = pl["formula"] if "formula" in pl else Pipeline("stage", 4, 8, v).bubble
        out[name] = {"bubble": pl["bubble"], "formula": formula, "ticks": pl["ticks"],
                     "peak_microbatches": max(pl["peak_microbatches"]),
                     "temp_bytes": temps}  # fmt: skip
    times = _timed(runs, rounds)
    for name in out:
        out[name]["step_ms"] = 1e3 * statistics.median(times[name])
        out[name]["time / gpipe"] = _ratio(times, name, "gpipe")
    return out


def hand_gpipe_step(trainer, model, batch, microbatches: int):
    """One step of the hand-written GPipe from ``trainer``'s state: its loss."""
    import jax

    compiled, state, sharding = hand_gpipe(trainer, model, batch, microbatches)
    _, _, loss = compiled(state["params"], state["opt"], jax.device_put(batch, sharding))
    return float(loss)


NOTE = (
    "On simulated devices the 8 stages share 2 cores, and every stage computes on eve"
    "ry tick (an idle tick's result is masked, as in MaxText's schedule): the bubble "
    "shows up as extra compute, (M+S-1)/M of the useful work, not as idle devices. Th"
    "e trend is the schedule's; the absolute ratios to dp need real devices."
)


SCHEDULE_NOTE = (
    "GPipe keeps each microbatch's stage inputs until the backward pass: its temporaries "
    "grow with M. The others hold at most about S microbatches' activations: flat in M. "
    "Their step times here include idle ticks that compute nothing on cores the stages "
    "share; on one real device (no bubble) benchmarks/gpu/ has each engine's cost."
)


def markdown(report: dict[str, Any]) -> str:
    eff, comp, rem = report["efficiency"], report["compile_seconds"], report["remat"]

    def ratio(r):
        return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"

    lines = [
        "# Pipeline parallelism and layer stacks, measured",
        "",
        f"`python benchmarks/pipeline.py`: {report['platform']}, 8 simulated CPU devices on "
        f"{report['cores']} cores, the reference transformer (NNX), batch "
        f"{report['batch']} (32 for remat), "
        f"{report['rounds']} interleaved rounds of {report['steps']} steps (median, and the "
        "range of the rounds' ratios: the noise).",
        "",
        "## Step time: pp (stage=8, 8 layers) against dp, and against a hand-written GPipe",
        "",
        "| contender | step ms | bubble |",
        "|---|---|---|",
        f"| dp | {eff['step_ms']['dp']:.1f} | |",
        f"| pp, M=8 | {eff['step_ms']['pp M=8']:.1f} | {eff['bubble']['M=8']:.3f} |",
        f"| pp, M=32 | {eff['step_ms']['pp M=32']:.1f} | {eff['bubble']['M=32']:.3f} |",
        f"| hand-written GPipe, M=32 | {eff['step_ms']['hand GPipe M=32']:.1f} | "
        f"{eff['bubble']['M=32']:.3f} |",
        "",
        f"pp M=8 / dp: {ratio(eff['pp M=8 / dp'])}; pp M=32 / dp: {ratio(eff['pp M=32 / dp'])}; "
        f"**pp M=32 / hand-written GPipe: {ratio(eff['pp M=32 / hand GPipe'])}**.",
        "",
        NOTE,
        "",
        "## Compile time of the training step, seconds",
        "",
        "| layers | stacked (scan) | unrolled |",
        "|---|---|---|",
        *[f"| {k} | {v['stacked']:.2f} | {v['unrolled']:.2f} |" for k, v in comp.items()],
        "",
        "## Rematerialisation (dp, 8 layers): temporaries per device and step time",
        "",
        "| remat | temporaries | / none | step ms | / none |",
        "|---|---|---|---|---|",
        f"| none | {rem['temp_bytes']['none'] / 1e6:.2f} MB | 1.000 | "
        f"{rem['step_ms']['none']:.1f} | 1.000 |",
        *[
            f"| {k} | {rem['temp_bytes'][k] / 1e6:.2f} MB | {rem['temp / none'][k]:.3f} | "
            f"{rem['step_ms'][k]:.1f} | {ratio(rem['time / none'][k])} |"
            for k in ("dots", "full")
        ],
        "",
        "## Schedules: pp on stage=4, 8 layers, microbatches of 4 rows",
        "",
        "| schedule | bubble at M=8 (formula) | activations held (microbatches) | "
        "temporaries at M=8 / 16 / 32 | step ms at M=8 | / gpipe |",
        "|---|---|---|---|---|---|",
        *[
            f"| {k} | {v['bubble']:.3f} ({v['formula']:.3f}) | {v['peak_microbatches']:g} | "
            + " / ".join(f"{t / 1e6:.2f}" for t in v["temp_bytes"].values())
            + f" MB | {v['step_ms']:.1f} | {ratio(v['time / gpipe'])} |"
            for k, v in report["schedules"].items()
        ],
        "",
        SCHEDULE_NOTE,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128, help="global batch of the pp runs")
    args = parser.parse_args()

    import os
    import platform
    from pathlib import Path

    from shardplug.core.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    report = {
        "platform": platform.machine(),
        "cores": os.cpu_count(),
        "rounds": args.rounds,
        "steps": args.steps,
        "batch": args.batch,
        "efficiency": efficiency(args.rounds, args.steps, args.batch),
        "compile_seconds": compile_depth(),
        "remat": remat(args.rounds, args.steps),
        "schedules": schedules(args.rounds, args.steps),
    }
    print(json.dumps(report, indent=1))
    (Path(__file__).parent / "pipeline.json").write_text(json.dumps(report, indent=1) + "\n")
    (Path(__file__).parent / "pipeline.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
