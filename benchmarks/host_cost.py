"""shardplug's per-step host cost, isolated from device time.

The same training loop over a model so small that the device time is negligible (an 8x8
linear layer, batch 8, one CPU device): ``Trainer.fit`` against the loop a JAX user writes
by hand (``jax.jit`` with donated state, the batch passed as numpy, the loss read every
``--log-every`` steps), in interleaved rounds. What remains between them is host work: the
loop, reading ahead, metrics and the in-flight bound. Two hand-written loops bound it: one
over the NNX state as Flax's documentation writes it (``nnx.split``; the pytree is flattened
in Python at every call), and the fastest a JAX loop can be, over a flat list of arrays.
shardplug's cost is measured against the fastest. The difference is then put next to the
reference transformer's step (dp, 8 simulated devices) as the fraction of a real step it
costs.

Run ``python benchmarks/host_cost.py`` (about a minute on 2 cores); ``--json`` prints the
figures only.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time


def _loops(steps: int, log_every: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import shardplug

    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32),
         "y": rng.normal(size=(8, 8)).astype(np.float32)}
        for _ in range(steps)
    ]  # fmt: skip

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def make_trainer():
        return shardplug.Trainer(
            shardplug.from_nnx(lambda rngs: nnx.Linear(8, 8, rngs=rngs)),
            loss_fn=loss_fn,
            optimizer=optax.adam(1e-3),
            strategy="dp",
            devices=1,
            log_every=log_every,
        )

    tx = optax.adam(1e-3)
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def by_hand_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def by_hand_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(by_hand_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def timed(step, state) -> float:
        """Seconds per step of ``state, loss = step(state, batch)``, losses read as fit does."""
        start = time.perf_counter()
        losses = []
        for i, batch in enumerate(batches):
            state, loss = step(state, batch)
            losses.append(loss)
            if (i + 1) % log_every == 0:
                jax.device_get(losses)
                losses.clear()
        jax.device_get(losses)
        return (time.perf_counter() - start) / steps

    def by_hand() -> float:
        def step(state, batch):
            p, s, loss = by_hand_step(*state, batch)
            return (p, s), loss

        p = jax.tree.map(jnp.copy, params)
        return timed(step, (p, tx.init(p)))

    leaves, treedef = jax.tree.flatten((params, tx.init(params)))

    @functools.partial(jax.jit, donate_argnums=0)
    def flat_step(leaves, batch):
        p, s, loss = by_hand_step.__wrapped__(*jax.tree.unflatten(treedef, leaves), batch)
        return jax.tree.leaves((p, s)), loss

    def by_hand_flat() -> float:
        return timed(flat_step, [jnp.copy(x) for x in leaves])

    def with_shardplug() -> float:
        trainer = make_trainer()
        trainer.compile(batches[0])
        start = time.perf_counter()
        trainer.fit(batches, steps=steps)
        return (time.perf_counter() - start) / steps

    by_hand(), by_hand_flat(), with_shardplug()  # warm up: compile, caches
    times: dict[str, list[float]] = {"by hand": [], "by hand, flat": [], "shardplug": []}
    for _ in range(rounds):
        times["by hand"].append(by_hand())
        times["by hand, flat"].append(by_hand_flat())
        times["shardplug"].append(with_shardplug())
    return {name: statistics.median(t) for name, t in times.items()} | {"rounds": times}


def _reference_step() -> float:
    """The reference transformer's median step under dp on 8 simulated devices, seconds."""
    import optax

    import shardplug

    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter("nnx"),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy="dp",
        log_every=10,
    )
    rows = trainer.fit(model.batches(model.batch_size, 0), steps=40)
    return statistics.median(r["step_time"] for r in rows[10:])


def measure(steps: int = 2000, log_every: int = 100, rounds: int = 5) -> dict:
    """Both parts, each in its own process (one CPU device for the loops, eight for the
    reference step), and the host cost derived from them."""
    out = {}
    for part in ("loops", "reference"):
        done = subprocess.run(
            [sys.executable, __file__, "--part", part, "--steps", str(steps),
             "--log-every", str(log_every), "--rounds", str(rounds)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    extra = out["shardplug"] - out["by hand, flat"]
    out["extra_us_per_step"] = extra * 1e6
    out["fraction_of_reference_step"] = extra / out["reference_step"]
    out["settings"] = {"steps": steps, "log_every": log_every, "rounds": rounds}
    return out


def section(out: dict) -> list[str]:
    """The figures as markdown, for benchmarks/results.md."""
    us = {k: out[k] * 1e6 for k in ("by hand", "by hand, flat", "shardplug")}
    settings = out["settings"]
    return [
        "## Host cost per step (`python benchmarks/host_cost.py`)",
        "",
        f"An 8x8 linear layer, batch 8, one CPU device, {settings['steps']} steps, metrics read "
        f"every {settings['log_every']}: median of {settings['rounds']} interleaved rounds.",
        "",
        "| loop | us per step |",
        "|---|---|",
        f"| by hand, `jax.jit` over the NNX state (`nnx.split`) | {us['by hand']:.1f} |",
        f"| by hand, `jax.jit` over a flat list of arrays | {us['by hand, flat']:.1f} |",
        f"| shardplug `Trainer.fit` | {us['shardplug']:.1f} |",
        "",
        f"shardplug's host cost over the fastest hand-written loop: "
        f"{out['extra_us_per_step']:+.1f} us per step, "
        f"{100 * out['fraction_of_reference_step']:.2f}% of the reference transformer's "
        f"{out['reference_step'] * 1e3:.1f} ms step (dp, 8 simulated devices).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--part", choices=("loops", "reference"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from shardplug.core.devices import simulate_cpu_devices

    if args.part == "loops":
        simulate_cpu_devices(1)
        print(json.dumps(_loops(args.steps, args.log_every, args.rounds)))
        return
    if args.part == "reference":
        simulate_cpu_devices(8)
        print(json.dumps({"reference_step": _reference_step()}))
        return
    out = measure(args.steps, args.log_every, args.rounds)
    extra = out["extra_us_per_step"] / 1e6
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(
        f"per step, median of {args.rounds} interleaved rounds of {args.steps} steps "
        f"(8x8 linear, batch 8, one CPU device, metrics every {args.log_every}):\n"
        f"  by hand, jax.jit over the NNX state:    {out['by hand'] * 1e6:7.1f} us\n"
        f"  by hand, jax.jit over a list of arrays: {out['by hand, flat'] * 1e6:7.1f} us\n"
        f"  shardplug Trainer.fit:                  {out['shardplug'] * 1e6:7.1f} us\n"
        f"  shardplug's host cost over the fastest: {extra * 1e6:+7.1f} us per step, "
        f"{100 * out['fraction_of_reference_step']:.2f}% of the reference transformer's "
        f"{out['reference_step'] * 1e3:.1f} ms step (dp, 8 simulated devices)"
    )


if __name__ == "__main__":
    main()
