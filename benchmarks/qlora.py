"""What a quantized base (QLoRA, ``--lora-quantize``) costs a model, on the pretrained fixtures.

For each family in ``tests/fixtures/hf``: the mean loss of the checkpoint as stored, and of
the same checkpoint with the adapters' targets stored in int8, int4 and nf4 (the adapters
start at zero, so the model evaluated is the dequantized base), on the same batches (the
fixtures' text where the family has a tokenizer, else the synthetic token chain); and the
bytes of those targets, stored against plain. Run:
``python benchmarks/qlora.py [--families llama,qwen2] [--batches 4] [--json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "mixtral")
QTYPES = ("int8", "int4", "nf4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import jax

    import shardplug
    from shardplug import pretrained

    rows = []
    for family in args.families.split(","):
        loaded = pretrained.load(FIXTURES / family)
        has_tokenizer = (FIXTURES / family / "tokenizer.json").is_file()
        text = str(FIXTURES / "text") if has_tokenizer else None  # else its synthetic tokens
        task = loaded.task("nnx", text=text, sequence=32, batch_size=4)
        batches = list(itertools.islice(task.batches(), args.batches))
        plain = task.trainer(strategy="dp", devices=1, precision="float32")
        row = {"family": family, "data": "text" if text else "synthetic",
               "plain": plain.evaluate(iter(batches))["loss"]}  # fmt: skip
        for qtype in QTYPES:
            tuned = shardplug.with_lora(task, 4, quantize=qtype)
            run = tuned.trainer(strategy="dp", devices=1, precision="float32")
            row[qtype] = run.evaluate(iter(batches))["loss"]
            targets = set(tuned.adapter.targets())
            stored = [
                x for p, x in zip(tuned.adapter.paths, jax.tree.leaves(
                    run.state.params["base"], is_leaf=_quantized), strict=True) if p in targets
            ]  # fmt: skip
            row[qtype + "_bytes"] = sum(x.nbytes for x in jax.tree.leaves(stored))
        row["plain_bytes"] = sum(
            x.nbytes for p, x in zip(tuned.adapter.paths, jax.tree.leaves(plain.state.params),
                                     strict=True) if p in targets
        )  # fmt: skip
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'family':8} {'data':9} {'plain':>7} " + " ".join(f"{q:>17}" for q in QTYPES)
          + "   targets' bytes: plain; " + ", ".join(QTYPES))  # fmt: skip
    for r in rows:
        losses = " ".join(f"{r[q]:7.4f} ({r[q] - r['plain']:+.4f})".rjust(17) for q in QTYPES)
        sizes = ", ".join(f"{r[q + '_bytes'] / r['plain_bytes']:.3f}x" for q in QTYPES)
        head = f"{r['family']:8} {r['data']:9} {r['plain']:7.4f}"
        print(f"{head} {losses}   {r['plain_bytes']} B; {sizes}")


def _quantized(x):
    from shardplug.finetuning.quantize import Quantized

    return isinstance(x, Quantized)


if __name__ == "__main__":
    main()
