"""Packed rows against padded ones: real tokens trained a second.

Fine-tuning text of documents shorter than ``--sequence`` either pads each document to a
row of its own or packs several into each row, their ``segment_ids`` keeping each to itself
in attention and their ``positions`` restarting at each (shardplug's packer,
``pretrained.text.Packed``). Both steps have the same shape, so they cost about the same;
packed rows carry more real tokens. This measures the Llama test fixture (NNX) on one CPU
device at ``--sequence`` (default 512), batch 8, documents of lognormal lengths (median
``--median``, default 96, within 8 and the sequence): each step compiled, the median step
time over interleaved rounds, and the targets each step counts (``loss_mask``), reported as
real tokens a second and as the packed step's time over the padded one's (what the segment
mask costs). On a GPU (``--precision bf16``) the packed rows take Pallas' flash kernel
(``shardplug.core.operations.flash``) and the padded ones cuDNN's fused attention; before the flash
kernel, an H100 measured the packed step at 14.5x the padded one at sequence 4096, on XLA's
masked attention.

Run ``python benchmarks/packing.py`` (about a minute on 2 cores); ``--json`` prints the
figures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf" / "llama"


def documents(count: int, median: int, sequence: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, count).astype(int), 8, sequence)
    return [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]


def padded_rows(docs: list, sequence: int, rows: int) -> dict:
    """Each document in a row of its own, cut to ``sequence + 1`` tokens, zeros after it."""
    import numpy as np

    tokens = np.zeros((rows, sequence + 1), np.int32)
    mask = np.zeros((rows, sequence), np.int32)
    for i, doc in enumerate(docs[:rows]):
        doc = doc[: sequence + 1]
        tokens[i, : len(doc)] = doc
        mask[i, : len(doc) - 1] = 1
    return {"tokens": tokens, "loss_mask": mask}


def packed_rows(docs: list, sequence: int, rows: int) -> dict:
    """The documents packed by shardplug's packer, ``rows`` rows of them."""
    import numpy as np

    from shardplug.pretrained.text import Packed

    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)]).astype(np.int32)
    packed = Packed(np.concatenate(docs), owner, sequence)
    got = [packed[i] for i in range(rows)]
    return {k: np.stack([r[k] for r in got]) for k in got[0]}


def measure(sequence: int, median: int, rows: int, steps: int, rounds: int,
            precision: str = "float32") -> dict:  # fmt: skip
    import jax

    from shardplug import pretrained

    loaded = pretrained.load(FIXTURE)
    task = loaded.task("nnx")
    docs = documents(rows * sequence // 8, median, sequence, loaded.config.vocab)
    batches = {"padded": padded_rows(docs, sequence, rows),
               "packed": packed_rows(docs, sequence, rows)}  # fmt: skip
    trainers, out = {}, {}
    for name, batch in batches.items():
        trainer = task.trainer(strategy="dp", devices=1, precision=precision)
        trainer.compile(batch)
        trainers[name] = trainer
        out[name] = {"targets_per_step": int(batch["loss_mask"].sum()), "times": []}
    for _ in range(rounds):  # interleaved: both see the same machine
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.fit([batches[name]] * steps, steps=steps)
            jax.block_until_ready(trainer.state.params)
            out[name]["times"].append((time.perf_counter() - start) / steps)
    for row in out.values():
        row["step_s"] = statistics.median(row.pop("times"))
        row["tokens_per_s"] = row["targets_per_step"] / row["step_s"]
    out["packed_over_padded"] = {
        "tokens_per_s": out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"],
        "step_s": out["packed"]["step_s"] / out["padded"]["step_s"],
    }
    out["setting"] = {"sequence": sequence, "median": median, "rows": rows,
                      "precision": precision, "device": jax.devices()[0].platform}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--precision",
        default="float32",
        help="bf16 on a GPU: the padded rows then take cuDNN's fused kernel",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.sequence, args.median, args.rows, args.steps, args.rounds,
                     args.precision)  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    for name in ("padded", "packed"):
        row = result[name]
        print(f"{name:<7} {row['step_s'] * 1e3:8.1f} ms/step {row['targets_per_step']:6d} "
              f"targets/step {row['tokens_per_s']:10.0f} tokens/s")  # fmt: skip
    ratio = result["packed_over_padded"]
    print(f"packed / padded: {ratio['tokens_per_s']:.2f}x tokens/s, {ratio['step_s']:.2f}x "
          f"step time (the segment mask's cost)")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
