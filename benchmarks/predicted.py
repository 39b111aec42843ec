"""The speed promises of shardplug's features, predicted on an H100 from its compiled
program, each beside its target.

``python benchmarks/predicted.py`` compiles each case for H100s that are not present
(JAX's CUDA plugin, ``JAX_PLATFORMS=cpu``) and predicts its step
(:func:`shardplug.predict_step`, calibrated by ``benchmarks/target_time.py``):

- the 1B GPT of ``gpu_mfu.py`` (batch 16 x 1024, bf16, AdamW), plain and with ``offload``
  (state; state and parameters), LoRA rank 16, QLoRA nf4, ``--addon float8`` (per tensor,
  per row), ``--remat full`` plain and with ``offload``, and ``--remat offload``: each step
  over the plain one;
- packed rows at 4096 tokens over padded ones (a Llama-shaped model of width 512, the one
  ``tests/test_targets.py`` compiles);
- pp's schedules on 4 GPUs (a 350M Llama of 24 layers, M = 8 and 16 microbatches): each
  step over the ideal, the same microbatches accumulated on one GPU divided by 4 (no bubble,
  nothing sent), beside the bubble formula;
- Llama-2-7B (batch 8 x 4096) on 8 GPUs under ``fsdp+tp`` and ``fsdp``.

It prints one JSON object (``--out FILE`` writes it too: benchmarks/gpu/h100_predicted.json)
and a table; ``--cases`` picks some.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent


def _gpt(addons: tuple = (), options: dict | None = None, remat: str = "none",
         lora: int | None = None, quantize: str | None = None) -> Callable[[], Any]:  # fmt: skip
    def compiled() -> Any:
        sys.path.insert(0, str(HERE))
        import gpu_mfu

        import shardplug
        from shardplug.core.compiled.targets import compile_noting, target_devices

        t = gpu_mfu.task("1b", 16, remat)
        if lora is not None:
            t = shardplug.with_lora(t, lora, quantize=quantize)
        trainer = shardplug.Trainer(
            t.adapter, loss_fn=t.loss_fn, optimizer=t.optimizer,
            strategy=shardplug.get_strategy("dp", addons=list(addons), **(options or {})),
            devices=target_devices("h100", 1), allocate=False, precision="bf16",
        )  # fmt: skip
        compile_noting(trainer, gpu_mfu.batches(gpu_mfu.SIZES["1b"], 16, 1)[0])
        return trainer.compiled

    return compiled


def _packing(packed: bool) -> Callable[[], Any]:
    def compiled() -> Any:
        import tempfile

        sys.path.insert(0, str(HERE))
        import packing

        from shardplug import pretrained
        from shardplug.core.compiled.targets import compile_noting, target_devices

        config = json.loads((ROOT / "tests" / "fixtures" / "hf" / "llama" / "config.json")
                            .read_text())  # fmt: skip
        config.update(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=1000,
                      max_position_embeddings=65536)  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            (pathlib.Path(folder) / "config.json").write_text(json.dumps(config))
            task = pretrained.load(folder).task("nnx")
            docs = packing.documents(4096 // 8, 512, 4096, 1000)
            rows = (packing.packed_rows if packed else packing.padded_rows)(docs, 4096, 1)
            trainer = task.trainer(strategy="dp", devices=target_devices("h100", 1),
                                   allocate=False, precision="bf16")  # fmt: skip
            compile_noting(trainer, rows)
            return trainer.compiled

    return compiled


def _llama(size: dict[str, int], batch: int, devices: int, strategy: Any, mesh: str | None,
           grad_accum: int = 1) -> Callable[[], Any]:  # fmt: skip
    def compiled() -> Any:
        sys.path.insert(0, str(HERE))
        import pipeline_engine

        import shardplug
        from shardplug.core.compiled.targets import compile_noting, target_devices

        llama = pipeline_engine.llama_example()
        config = dataclasses.replace(llama.Config(), **size, batch=batch, remat="none")
        task = llama.task_of(config, "llama")
        how = strategy
        if isinstance(how, tuple):
            how = shardplug.get_strategy(how[0], **how[1])
        trainer = task.trainer(strategy=how, devices=target_devices("h100", devices),
                               mesh=mesh, grad_accum=grad_accum, precision="bf16",
                               allocate=False)  # fmt: skip
        compile_noting(trainer, next(itertools.islice(task.batches(), 1)))
        return trainer.compiled

    return compiled


def _llama7b(strategy: str, mesh: str | None) -> Callable[[], Any]:
    def compiled() -> Any:
        sys.path.insert(0, str(HERE))
        import pipeline_engine

        import shardplug
        from shardplug.core.compiled.targets import compile_noting, target_devices

        task = pipeline_engine.llama_example().llama2_7b()
        trainer = task.trainer(strategy=shardplug.get_strategy(strategy),
                               devices=target_devices("h100", 8), mesh=mesh,
                               precision="bf16", allocate=False)  # fmt: skip
        compile_noting(trainer, next(iter(task.batches())))
        return trainer.compiled

    return compiled


_350M = {"layers": 24, "width": 1024, "heads": 16, "mlp": 2816, "vocab": 32000, "sequence": 1024}


def _pp(schedule: str, m: int) -> Callable[[], Any]:
    return _llama(_350M, 32, 4, ("pp", {"microbatches": m, "schedule": schedule}), "stage=4")


#: name -> (how to compile it, the case it is compared with, the target ratio, "<=" or ">=",
#: what the ratio is)
CASES: dict[str, tuple[Callable[[], Any], str | None, float | None, str, str]] = {
    "1b plain": (_gpt(), None, None, "", ""),
    "1b offload": (_gpt(("offload",)), "1b plain", 1.5, "<=", "step over the plain step"),
    "1b offload params": (_gpt(("offload",), {"offload.params": True}), "1b plain", 1.5, "<=",
                          "step over the plain step"),
    "1b lora16": (_gpt(lora=16), "1b plain", 0.75, "<=", "step over the full fine-tune's"),
    "1b qlora16 nf4": (_gpt(lora=16, quantize="nf4"), "1b plain", 0.85, "<=",
                       "step over the full fine-tune's"),
    "1b float8": (_gpt(("float8",)), "1b plain", 1 / 1.2, "<=",
                  "step over bf16's (1.2x faster: <= 0.833)"),
    "1b float8 row": (_gpt(("float8",), {"float8.scaling": "row"}), "1b plain", 1 / 1.2, "<=",
                      "step over bf16's (1.2x faster: <= 0.833)"),
    "1b remat full": (_gpt(remat="full"), "1b plain", None, "", "step over the plain step"),
    "1b remat full offload": (_gpt(("offload",), remat="full"), "1b remat full", 1.5, "<=",
                              "step over --remat full's"),
    "1b remat offload": (_gpt(remat="offload"), "1b remat full", 1.5, "<=",
                         "step over --remat full's"),
    "packed 4096": (_packing(True), "padded 4096", 1.15, "<=", "step over padded rows'"),
    "padded 4096": (_packing(False), None, None, "", ""),
    **{f"pp S=4 M={m} accumulation": (_llama(_350M, 32, 1, "dp", None, grad_accum=m), None,
                                      None, "", "") for m in (8, 16)},
    **{f"pp S=4 M={m} {s}": (_pp(s, m), f"pp S=4 M={m} accumulation", None, "",
                             "step over a quarter of one GPU's accumulation (the ideal)")
       for m in (8, 16) for s in ("gpipe", "1f1b", "zb")},
    "7b fsdp": (_llama7b("fsdp", None), None, None, "", ""),
    "7b fsdp+tp": (_llama7b("fsdp+tp", "fsdp=4,model=2"), "7b fsdp", None, "",
                   "step over fsdp's"),
}  # fmt: skip


def _bubble(name: str) -> float | None:
    """The schedule's bubble by its formula, S = 4 (GPipe and 1F1B: (S-1)/(M+S-1); ZB-H1:
    (S-1)/(3M+S-1))."""
    if not name.startswith("pp S=4") or name.endswith("accumulation"):
        return None
    m, schedule = int(name.split()[2][2:]), name.split()[3]
    return 3 / (3 * m + 3) if schedule == "zb" else 3 / (m + 3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    names = list(CASES) if args.cases is None else [c.strip() for c in args.cases.split(",")]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: no case {unknown[0]!r}; choose from {', '.join(CASES)}")
    wanted = set(names) | {CASES[n][1] for n in names if CASES[n][1]}
    from shardplug.core.compiled.targets import on_cpu_alone

    on_cpu_alone()  # before JAX starts its backends
    import jax

    import shardplug

    steps = {n: shardplug.predict_step(CASES[n][0]()) for n in CASES if n in wanted}
    rows = []
    for name in names:
        _, base, target, sense, what = CASES[name]
        step = steps[name]
        row = {"case": name, "predicted_seconds": step.seconds,
               "parts_seconds": {k: round(v["seconds"], 6) for k, v in step.parts.items()},
               "exposed_seconds": step.exposed_seconds}  # fmt: skip
        if base is not None:
            ideal = steps[base].seconds / (4 if name.startswith("pp S=4") else 1)
            ratio = step.seconds / ideal
            row.update(over=base, ratio=ratio, what=what)
            if target is not None:
                row.update(target=f"{sense} {target:.3f}",
                           meets=ratio <= target if sense == "<=" else ratio >= target)  # fmt: skip
        if _bubble(name) is not None:
            row["bubble_formula"] = _bubble(name)
        rows.append(row)
    result = {"target": "h100", "jax": jax.__version__, "cases": rows}
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    for r in rows:
        verdict = ("" if "meets" not in r else ("  meets " if r["meets"] else "  MISSES ")
                   + r["target"])  # fmt: skip
        ratio = f"  {r['ratio']:.3f}x {r['what']}" if "ratio" in r else ""
        print(f"{r['case']:<26} {r['predicted_seconds'] * 1e3:9.1f} ms{ratio}{verdict}",
              file=sys.stderr)  # fmt: skip
    print(text)
    return result


if __name__ == "__main__":
    from shardplug.errors import ShardplugError

    try:
        main()
    except ShardplugError as exc:
        sys.exit(print(f"predicted: error: {exc}", file=sys.stderr) or 2)
