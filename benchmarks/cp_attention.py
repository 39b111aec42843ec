"""cp's attention schemes side by side: keys and values all-gathered, passed round the ring
(with and without the zig-zag balance of causal work), all-to-all (Ulysses: the heads split
for attention), or the hybrid (all-to-alls within groups the heads divide, a ring across).

The reference transformer (NNX, causal, 4 heads) at ``--sequences`` (default 1024 and 4096),
batch 4, under ``cp`` on ``--devices`` simulated CPU devices (context = devices), with
``scheme="gather"``, ``scheme="ring"`` and ``balance="none"`` (every block pair computed,
masked), the default ``scheme="ring"``, ``balance="zigzag"``, ``scheme="ulysses"`` (where
the 4 heads divide the devices) and ``scheme="hybrid"`` (where they do not: on 8 devices,
groups of 4 and a ring of 2): each step compiled, its compiled temporaries
(``memory_analysis``), the bytes its collectives send, and the median step time over
interleaved rounds, reported as ratios to the gather. The same losses are asserted, so all
compute the same thing. Sequences longer than ``--timed-up-to`` (default 4096) are planned
only (compiled, nothing allocated: temporaries and bytes, no time), since the gather's
scores at 16k would not fit this machine. A GPU run records the attention function's
kernel time instead (one GPU has no ring); none was lent when this was written.

Run ``python benchmarks/cp_attention.py`` (a few minutes on 2 cores); ``--json`` prints the
figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMES = {
    "gather": {"scheme": "gather"},
    "ring": {"scheme": "ring", "balance": "none"},
    "ring+zigzag": {"scheme": "ring", "balance": "zigzag"},
    "ulysses": {"scheme": "ulysses"},
    "hybrid": {"scheme": "hybrid"},
}


def measure(sequences: list[int], devices: int, steps: int, rounds: int,
            timed_up_to: int = 4096) -> dict:  # fmt: skip
    import jax
    import numpy as np

    import shardplug
    from shardplug.core.compiled.hlo import collectives
    from shardplug.strategies.cp.ulysses import group_size

    model = shardplug.get_model("transformer")
    heads = 4  # the reference transformer's
    # Ulysses where the heads divide the devices; the hybrid where they do not (where they
    # do, it is Ulysses)
    schemes = {
        k: v
        for k, v in SCHEMES.items()
        if k not in ("ulysses", "hybrid") or (k == "ulysses") == (heads % devices == 0)
    }
    out = {}
    for length in sequences:
        timed = length <= timed_up_to
        batch = next(model.batches(4, 0, sequence=length))
        trainers, rows = {}, {}
        for scheme, options in schemes.items():
            task = model.task("nnx", sequence=length, batch_size=4)
            trainer = task.trainer(strategy=shardplug.get_strategy("cp", **options),
                                   devices=devices, allocate=timed)  # fmt: skip
            trainer.compile(batch)
            found = collectives(trainer.compiled.as_text())
            trainers[scheme] = trainer
            rows[scheme] = {
                "temp_bytes": trainer.compiled.memory_analysis().temp_size_in_bytes,
                "collectives": {c.kind: {"count": c.count, "sent": c.wire_bytes} for c in found},
                "sent_bytes": sum(c.wire_bytes for c in found),  # what each device sends
                "times": [],
            }
            if scheme == "hybrid":
                rows[scheme]["groups"] = group_size(heads, heads, devices)
        if not timed:  # planned: the compiled program's figures alone
            for row in rows.values():
                del row["times"]
                row["over_gather"] = {
                    key: row[key] / rows["gather"][key] for key in ("temp_bytes", "sent_bytes")
                }
            out[length] = rows
            continue
        for _ in range(rounds):  # interleaved, so both see the same machine
            for scheme, trainer in trainers.items():
                start = time.perf_counter()
                history = trainer.fit([batch] * steps, steps=steps)
                jax.block_until_ready(trainer.state.params)
                rows[scheme]["times"].append((time.perf_counter() - start) / steps)
                rows[scheme]["loss"] = history[-1]["loss"]
        for row in rows.values():
            np.testing.assert_allclose(row["loss"], rows["gather"]["loss"], rtol=1e-4)
            row["step_s"] = statistics.median(row.pop("times"))
        for row in rows.values():
            row["over_gather"] = {
                key: row[key] / rows["gather"][key]
                for key in ("temp_bytes", "step_s", "sent_bytes")
            }
        out[length] = rows
    return out


def textbook_ring(q, k, v, *, axis: str, size: int):
    """Causal ring attention as one writes it by hand from JAX's shard_map notebook: a
    ``fori_loop`` of ``size`` steps, each meeting the key/value block at hand with an
    online softmax (masked at the global positions) and passing it on. No balance, no
    rematerialisation policy: the plain program, to measure shardplug's against."""
    import jax
    import jax.numpy as jnp

    length = q.shape[1]
    me = jax.lax.axis_index(axis)
    rows = me * length + jnp.arange(length)
    scale = q.shape[-1] ** -0.5

    def body(step, carry):
        top, total, out, k, v = carry
        source = (me - step) % size
        cols = source * length + jnp.arange(length)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        scores = jnp.where(rows[:, None] >= cols[None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(-1))
        safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.exp(scores - safe[..., None])
        fade = jnp.exp(jnp.where(jnp.isfinite(top), top - safe, -jnp.inf))
        total = total * fade + weights.sum(-1)
        out = out * fade.transpose(0, 2, 1)[..., None] + jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        k, v = jax.lax.ppermute((k, v), axis, [(d, (d + 1) % size) for d in range(size)])
        return new_top, total, out, k, v

    zeros = jnp.zeros_like(q[..., 0]).transpose(0, 2, 1)  # varying over the axis, like q
    _, total, out, _, _ = jax.lax.fori_loop(
        0, size, body, (zeros - jnp.inf, zeros, jnp.zeros_like(q), k, v)
    )
    return out / total.transpose(0, 2, 1)[..., None]


def attention_alone(sequences: list[int], devices: int, rounds: int) -> dict:
    """Causal attention alone, forward and backward (the gradient of a weighted sum of its
    output for all three inputs), batch 1, 8 heads of 64, on ``devices`` CPU devices: the
    textbook ring above against shardplug's (without and with the zig-zag) and the gather,
    median seconds over interleaved rounds; all equal to one another (asserted)."""
    import functools

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplug.strategies.cp.ring import gathered_attention, ring_attention
    from shardplug.strategies.cp.ulysses import ulysses_attention

    mesh = jax.make_mesh((devices,), ("context",), devices=jax.devices()[:devices])
    split = P(None, "context")

    def by_hand(q, k, v, causal, bias, mask, scale):
        block = functools.partial(textbook_ring, axis="context", size=devices)
        return jax.shard_map(block, in_specs=(split,) * 3, out_specs=split, axis_names={"context"})(
            q, k, v
        )

    contenders = {
        "by hand": by_hand,
        "ring": ring_attention("context", balance=False),
        "ring+zigzag": ring_attention("context", balance=True),
        "gather": gathered_attention("context"),
        "ulysses": ulysses_attention("context"),
    }
    out = {}
    for length in sequences:
        q, k, v = jax.random.normal(jax.random.key(0), (3, 1, length, 8, 64))
        weights = jax.random.normal(jax.random.key(1), (1, length, 8, 64))
        with jax.set_mesh(mesh):
            q, k, v = (jax.device_put(x, NamedSharding(mesh, split)) for x in (q, k, v))
            steps, temp = {}, {}
            for name, attend in contenders.items():

                def loss(q, k, v, attend=attend, weights=weights):
                    y = attend(q, k, v, causal=True, bias=None, mask=None, scale=None)
                    return (y * weights).sum()

                steps[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
                steps[name](q, k, v)[0].block_until_ready()  # compiled, warmed
                compiled = steps[name].lower(q, k, v).compile()
                temp[name] = compiled.memory_analysis().temp_size_in_bytes
            times = {name: [] for name in contenders}
            for _ in range(rounds):
                for name, step in steps.items():
                    start = time.perf_counter()
                    jax.block_until_ready(step(q, k, v))
                    times[name].append(time.perf_counter() - start)
            results = {name: step(q, k, v) for name, step in steps.items()}
        for got in results.values():
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(results["by hand"]), strict=True):
                np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
        hand = statistics.median(times["by hand"])
        out[length] = {
            name: {
                "seconds": statistics.median(t), "over_by_hand": statistics.median(t) / hand,
                "temp_bytes": temp[name], "temp_over_by_hand": temp[name] / temp["by hand"],
            }
            for name, t in times.items()
        }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="1024,4096")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--timed-up-to", type=int, default=4096,
        help="sequences longer than this are compiled only (temporaries and bytes, no time)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--alone", action="store_true",
        help="time attention alone (forward and backward) against a ring written by hand",
    )  # fmt: skip
    args = parser.parse_args()
    import shardplug

    shardplug.simulate_cpu_devices(args.devices)
    sequences = [int(s) for s in args.sequences.split(",")]
    if args.alone:
        alone = attention_alone(sequences, args.devices, args.rounds)
        if args.json:
            print(json.dumps(alone, indent=1))
            return
        for length, rows in alone.items():
            print(f"causal attention alone, sequence {length}, context {args.devices}:")
            for name, row in rows.items():
                print(
                    f"  {name:<12} {row['seconds'] * 1e3:9.1f} ms "
                    f"{row['temp_bytes'] / 2**20:8.1f} MiB   / by hand: time "
                    f"{row['over_by_hand']:.2f}, memory {row['temp_over_by_hand']:.2f}"
                )
        return
    result = measure(sequences, args.devices, args.steps, args.rounds, args.timed_up_to)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for length, rows in result.items():
        print(f"sequence {length}, context {args.devices}:")
        for scheme, row in rows.items():
            ratio = row["over_gather"]
            time_s = (f"{row['step_s'] * 1e3:8.1f} ms/step " if "step_s" in row
                      else "   planned only ")  # fmt: skip
            over = f"time {ratio['step_s']:.2f}, " if "step_s" in ratio else ""
            print(
                f"  {scheme:<12} {time_s}{row['temp_bytes'] / 2**20:8.1f} MiB temporaries "
                f"{row['sent_bytes'] / 1e6:7.1f} MB sent   / gather: {over}memory "
                f"{ratio['temp_bytes']:.2f}, bytes {ratio['sent_bytes']:.2f}"
            )
            print(f"    collectives: {row['collectives']}")


if __name__ == "__main__":
    main()
