"""What checkpointing every K steps costs a training loop, measured side by side.

Trains each model in interleaved rounds in one process: without checkpoints, and saving
every K = 10, 5 and 1 steps, in the persistent tier (Orbax, asynchronous, sharded) and in the
frequent local tier (``running/local_checkpoint.py``: each process's shards, copied to host
memory, then written by a thread). Every run saves once more at its end, persistent, as
``fit`` does. Reports, per K, the median step time over whole rounds (saves included) as a
share over no checkpointing; beside it the floor, what copying the state off the devices once
costs (``jax.device_get`` of it: a save should block the step for that copy and nothing
else), the time each tier's ``save()`` blocks the loop, the time the background write takes
to finish, and the steps a failure loses (on average
K/2, at most K - 1 plus the steps in flight). Models: the reference transformer and a
Llama-shaped decoder of about 100M parameters (``examples/tasks/llama.py``: 12 layers of
width 768), on 8 simulated CPU devices under ``fsdp``.

Run: ``python benchmarks/checkpoint_overhead.py [--steps 20 --rounds 3] [--json]``.
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
import tempfile
import time
from typing import Any

from shardplug.core.devices import simulate_cpu_devices

EVERY = (10, 5, 1)


def _tasks() -> dict[str, Any]:
    import optax

    import shardplug

    model = shardplug.get_model("transformer")
    reference = shardplug.Task(model.adapter("nnx"), model.loss_fn,
                               optax.adam(model.learning_rate),
                               data=lambda: model.batches(model.batch_size, 0),
                               name="transformer")  # fmt: skip
    path = pathlib.Path(__file__).parent.parent / "examples" / "tasks" / "llama.py"
    spec = importlib.util.spec_from_file_location("llama_example", path)
    llama = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = llama
    spec.loader.exec_module(llama)
    config = dataclasses.replace(llama.Config(), layers=12, width=768, heads=12, mlp=2048,
                                 vocab=32000, sequence=128, batch=8, remat="none")  # fmt: skip
    return {"transformer": reference, "llama-100m": llama.task_of(config, "llama-100m")}


def _measure(task: Any, strategy: str, steps: int, rounds: int,
             tiers: tuple[str, ...] = ("persistent", "local")) -> dict[str, Any]:  # fmt: skip
    import jax

    from shardplug.running.local_checkpoint import LocalCheckpoints

    data = list(itertools.islice(task.batches(), 4))
    kinds: list[tuple[str, int | None]] = [("none", None)]
    kinds += [(tier, k) for tier in tiers for k in EVERY]
    times: dict[tuple[str, int | None], list[float]] = {k: [] for k in kinds}
    blocking, writing, copying, local_blocking, local_writing, cpu = [], [], [], [], [], []
    trainer = None
    ram = "/dev/shm" if pathlib.Path("/dev/shm").is_dir() else None
    for _ in range(rounds):
        for tier, every in kinds:
            with tempfile.TemporaryDirectory() as folder, \
                    tempfile.TemporaryDirectory(dir=ram) as shm:
                # every run saves once at its end, persistent (as fit does): alike in all kinds
                how = {"checkpoint_every": every} if tier == "persistent" else {}
                if tier == "local":  # in a RAM disk, as docs/distributed.md advises
                    how = {"local_checkpoint_dir": f"{shm}/local-{every}",
                           "local_checkpoint_every": every}  # fmt: skip
                trainer = task.trainer(strategy=strategy, log_every=steps,
                                       checkpoint_dir=f"{folder}/persistent", **how)  # fmt: skip
                trainer.fit(itertools.islice(itertools.cycle(data), 2), 2)  # compile, warm
                trainer.checkpoints.wait()
                start = time.perf_counter()
                trainer.fit(itertools.islice(itertools.cycle(data), steps), steps)
                jax.block_until_ready(trainer.state.params)
                trainer._saver.wait()
                times[tier, every].append((time.perf_counter() - start) / steps)
                if every != 1:
                    continue
                # one more save, timed on its own; and the copy off the devices
                if tier == "persistent":
                    begin = time.perf_counter()
                    trainer.checkpoints.save(10**6, trainer.state, {})
                    blocking.append(time.perf_counter() - begin)
                    trainer.checkpoints.wait()
                    writing.append(time.perf_counter() - begin)
                    begin = time.perf_counter()
                    jax.device_get(trainer.state)
                    copying.append(time.perf_counter() - begin)
                else:
                    local = LocalCheckpoints(f"{shm}/local-{every}")
                    begin = time.perf_counter()
                    local.save(10**6, trainer.state, {})
                    local_blocking.append(time.perf_counter() - begin)
                    local.wait()
                    local_writing.append(time.perf_counter() - begin)
                    cpu.append(local.written[1])
    plain = statistics.median(times["none", None])
    state = sum(x.nbytes for x in jax.tree.leaves(trainer.state) if hasattr(x, "nbytes"))
    params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    return {
        "model": task.name, "parameters": params, "state_bytes": state,
        "step_ms": 1e3 * plain,
        "every": {f"{tier} {k}": {"step_ms": 1e3 * statistics.median(times[tier, k]),
                                  "over_plain": statistics.median(times[tier, k]) / plain - 1,
                                  "steps_lost_mean": k / 2, "steps_lost_most": k - 1}
                  for tier, k in kinds if k},
        "copy_off_devices_ms": _ms(copying), "save_blocks_ms": _ms(blocking),
        "save_completes_ms": _ms(writing), "local_save_blocks_ms": _ms(local_blocking),
        "local_save_completes_ms": _ms(local_writing), "local_write_cpu_ms": _ms(cpu),
    }  # fmt: skip


def _ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="transformer,llama-100m")
    parser.add_argument("--tiers", default="persistent,local")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    simulate_cpu_devices(args.devices)
    tasks = _tasks()
    tiers = tuple(args.tiers.split(","))
    rows = [_measure(tasks[m], args.strategy, args.steps, args.rounds, tiers)
            for m in args.models.split(",")]  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        said = [f"{r['model']} ({r['parameters'] / 1e6:.1f}M parameters, state "
                f"{r['state_bytes'] / 1e6:.1f} MB): {r['step_ms']:.1f} ms a step without "
                f"checkpoints"]  # fmt: skip
        if r["save_blocks_ms"] is not None:
            said.append(f"copying the state off the devices {r['copy_off_devices_ms']:.1f} ms; "
                        f"a persistent save blocks {r['save_blocks_ms']:.1f} ms and completes "
                        f"in {r['save_completes_ms']:.1f} ms")  # fmt: skip
        if r["local_save_blocks_ms"] is not None:
            said.append(f"a local one blocks {r['local_save_blocks_ms']:.1f} ms and completes "
                        f"in {r['local_save_completes_ms']:.1f} ms, its writing thread using "
                        f"{r['local_write_cpu_ms']:.1f} ms of a core")  # fmt: skip
        print("; ".join(said))
        for k, e in r["every"].items():
            print(f"  {k:>13}: {e['step_ms']:.1f} ms a step ({e['over_plain']:+.1%}), a "
                  f"failure loses {e['steps_lost_mean']:.1f} steps on average, "
                  f"{e['steps_lost_most']} at most")  # fmt: skip


if __name__ == "__main__":
    main()
