"""The step-time predictor checked where it can be measured: on this machine's CPU.

``python benchmarks/cpu_time.py`` measures the CPU's figures once, by micro-benchmarks
(an f32 matrix product's FLOP/s, a streaming kernel's bytes a second, what a loop's
iteration and a kernel cost beyond their work, a collective's latency between simulated
devices), makes them a :class:`shardplug.Chip`, then, for the reference models under
several strategies, predicts each compiled step with :func:`shardplug.predict_step` and
measures it (median of interleaved rounds), and prints the errors. The same method as on
a GPU (:mod:`shardplug.core.compiled.timing`): only the figures differ. Simulated CPU devices take
turns on the machine's cores, so a step of N devices is predicted as N of its per-device
programs run one after another (``Chip.shared_by``).

``--json`` prints one JSON object; ``--out FILE`` writes it (benchmarks/cpu_time.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

#: (model, strategy, devices, options): the cases predicted and measured
CASES = (
    ("mlp", "dp", 1, {}),
    ("transformer", "dp", 1, {}),
    ("cnn", "dp", 1, {}),
    ("transformer", "dp", 8, {}),
    ("transformer", "fsdp", 8, {}),
    ("transformer", "fsdp+tp", 8, {}),
    ("transformer", "pp", 4, {"layers": 4}),
    ("mlp", "fsdp", 8, {}),
    ("cnn", "fsdp", 8, {}),
    ("transformer", "dp", 1, {"grad_accum": 4}),
)


def _timed(fn: Any, *args: Any, repeat: int = 5) -> float:
    """The median seconds of ``fn(*args)`` (compiled, warmed)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_chip() -> Any:
    """This CPU's figures, measured on one device (its kernels use every core)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax import lax

    import shardplug
    from shardplug.core.compiled.chips import Chip

    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    product = _timed(jax.jit(lambda a: a @ a), a)
    flops = 2 * n**3 / product
    # a streaming kernel over 4 MB, the size of the reference models' activations (a CPU
    # reads them from its caches, not from memory)
    x = jnp.ones((1 << 20,), jnp.float32)
    stream = _timed(jax.jit(lambda x: x * 2.0 + 1.0), x, repeat=50)
    bandwidth = 2 * x.nbytes / stream
    tiny = jnp.ones((2, 2), jnp.float32)
    chain = 64

    def dots(v):  # products one after another: one kernel each, nothing to fuse
        for _ in range(chain):
            v = v @ v
        return v

    launch = _timed(jax.jit(dots), tiny, repeat=50) / chain
    trips = 2000
    looped = _timed(jax.jit(lambda v: lax.fori_loop(0, trips, lambda i, v: v @ v, v)), tiny)
    iteration = max(looped / trips - launch, 0.0)
    chip = Chip("cpu", flops={k: flops for k in ("f32", "bf16", "f16", "f64", "s8")},
                vector=bandwidth, special=bandwidth / 8, bandwidth=bandwidth,
                links={"local": bandwidth, "network": bandwidth}, pcie=bandwidth,
                launch_seconds=launch, loop_seconds=iteration, gemm_efficiency=1.0,
                memory_efficiency=1.0, latency={"local": 0.0, "network": 0.0})  # fmt: skip
    latency = _collective_latency() - launch  # a kernel's cost is counted apart
    chip = dataclasses.replace(chip, latency={"local": latency, "network": latency})
    del shardplug
    return chip


def _collective_latency() -> float:
    """Seconds one small all-reduce over the 8 simulated devices costs, beyond its bytes."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    trips = 200

    def per_device(v):
        return lax.fori_loop(0, trips, lambda i, v: lax.psum(v, "d") * 0.125, v)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                 check_vma=False))
    return _timed(step, jnp.ones((8, 8), jnp.float32)) / trips


def _case(model: str, strategy: str, devices: int, options: dict, chip: Any,
          steps: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    import dataclasses

    import jax
    import optax

    import shardplug

    reference = shardplug.get_model(model)
    layers = options.get("layers")
    adapter = reference.adapter("nnx", **({"layers": layers} if layers else {}))
    trainer = shardplug.Trainer(
        adapter, loss_fn=reference.loss_fn, optimizer=optax.adam(reference.learning_rate),
        strategy=strategy, devices=devices, grad_accum=options.get("grad_accum", 1),
        log_every=10_000,
    )  # fmt: skip
    data = [next(reference.batches(16 if model == "cnn" else 32, 0))]
    trainer.fit(data * 3, 3)  # compile, warm
    # the compiled step alone, called on the run's own state: no loop around it (what the
    # predictor predicts is the program's time, not the host's)
    program, run = trainer.program, trainer._run
    batch = jax.device_put(data[0], program.batch_shardings)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            run.leaves, metrics = program.compiled(run.leaves, batch)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start) / steps)
    measured = statistics.median(times)
    shared = dataclasses.replace(chip, shared_by=devices)
    predicted = shardplug.predict_step(trainer.compiled, shared).seconds
    return {"model": model, "strategy": strategy, "devices": devices, "options": options,
            "measured_seconds": measured, "predicted_seconds": predicted,
            "error": predicted / measured - 1}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    from shardplug.core.devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    import dataclasses

    chip = measure_chip()
    rows = [_case(*case, chip, args.steps, args.rounds) for case in CASES]
    errors = [abs(r["error"]) for r in rows]
    result = {"chip": dataclasses.asdict(chip), "cases": rows,
              "median_error": statistics.median(errors), "worst_error": max(errors)}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
        return result
    print(f"CPU: {chip.flops['f32'] / 1e9:.1f} GFLOP/s f32 products, "
          f"{chip.bandwidth / 1e9:.1f} GB/s, {chip.launch_seconds * 1e6:.1f} us a kernel, "
          f"{chip.loop_seconds * 1e6:.1f} us a loop iteration, "
          f"{chip.latency['local'] * 1e6:.1f} us a collective")  # fmt: skip
    for r in rows:
        print(f"{r['model']:<12} {r['strategy']:<8} x{r['devices']} {json.dumps(r['options']):<20}"
              f" measured {r['measured_seconds'] * 1e3:8.2f} ms  predicted "
              f"{r['predicted_seconds'] * 1e3:8.2f} ms  {r['error']:+.1%}")  # fmt: skip
    print(f"median |error| {result['median_error']:.1%}, worst {result['worst_error']:.1%}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
