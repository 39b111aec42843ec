"""Step times predicted from the H100's program compiled on a CPU machine, against every H100
step time the project holds.

``python benchmarks/target_time.py`` compiles, for one H100 that is not present (``explain
--target h100``: JAX's CUDA plugin, ``JAX_PLATFORMS=cpu``), each step an H100 has timed
(``benchmarks/gpu/``):

- the GPT of ``gpu_mfu.py`` at 125m, 350m and 1b through shardplug and by hand
  (``h100_mfu_SIZE.json``), and each case ``check.sh`` writes when a GPU next runs
  (``h100_SIZE-CASE.json``: offload, LoRA, QLoRA, float8, remat);
- the pipeline engines of ``pipeline_engine.py`` at M = 8 and 16
  (``h100_pipeline_engine_350m_mM.json``);

predicts each with :func:`shardplug.predict_step` (a pipeline engine's record older than
the engine the code now runs keeps the prediction made from the program it measured:
``"frozen"``), fits the constants the method needs on
the points named in :data:`FIT` (and no other), and prints one JSON object: the constants,
and each point's measured and predicted seconds, its error, and whether it was in the fit.
``--out FILE`` writes it too (``benchmarks/gpu/h100_target_time.json``, which
``tests/test_targets.py`` reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).parent
GPU = HERE / "gpu"
#: the points each fitted constant is solved on; every other point is a check
FIT = {"gemm_efficiency": "gpt-1b shardplug", "memory_efficiency": "llama-350m M=8 dp"}


def _gpt(record: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The compiled steps of a ``gpu_mfu.py`` record: shardplug's and the hand-written."""
    sys.path.insert(0, str(HERE))
    import gpu_mfu

    import shardplug
    from shardplug.core.compiled.targets import as_present, compile_noting, target_devices

    size = gpu_mfu.SIZES[record["size"]]
    batch, remat = record["batch"], record.get("remat", "none")

    def ours() -> Any:
        t = gpu_mfu.task(record["size"], batch, remat)
        if record.get("lora") is not None:
            t = shardplug.with_lora(t, record["lora"], quantize=record.get("lora_quantize"))
        options = dict(o.split("=", 1) for o in record.get("options") or [])
        options = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in options.items()}
        trainer = shardplug.Trainer(
            t.adapter, loss_fn=t.loss_fn, optimizer=t.optimizer,
            strategy=shardplug.get_strategy("dp", addons=record.get("addons") or [], **options),
            devices=target_devices("h100", 1), allocate=False, precision="bf16",
        )  # fmt: skip
        compile_noting(trainer, gpu_mfu.batches(size, batch, 1)[0])
        return trainer.compiled

    def theirs() -> Any:
        device = target_devices("h100", 1)[0]
        _, _, traced = gpu_mfu.hand_written(size, batch, remat, device=device)
        with as_present(device):
            return traced.lower().compile()

    return {"shardplug": ours, "hand_written": theirs}


def points() -> list[dict[str, Any]]:
    """Every H100 step time of ``benchmarks/gpu/``: its name, seconds and how to compile it."""
    out = []
    for path in sorted(GPU.glob("h100_*.json")):
        record = json.loads(path.read_text())
        if "shardplug" in record and "hand_written" in record:  # gpu_mfu.py's
            name = "gpt-" + path.stem.removeprefix("h100_").removeprefix("mfu_")
            compile_ = _gpt(record)
            for who in ("shardplug", "hand_written"):
                out.append({"point": f"{name} {who}", "file": path.name,
                            "measured_seconds": record[who]["step_seconds"],
                            "compile": compile_[who]})  # fmt: skip
        elif "contenders" in record:  # pipeline_engine.py's
            for contender, found in record["contenders"].items():
                name = contender.split(",")[0]
                point = f"llama-{record['size']} M={record['microbatches']} {name}"
                row = {"point": point, "file": path.name,
                       "measured_seconds": found["step_ms"] / 1e3,
                       "compile": _engine(record, contender)}  # fmt: skip
                if contender.startswith("pp") and record.get("engine", 1) < _engine_now():
                    row["frozen"] = _recorded(point)  # the program measured is gone
                out.append(row)
    return out


def _engine_now() -> int:
    sys.path.insert(0, str(HERE))
    import pipeline_engine

    return pipeline_engine.ENGINE


def _recorded(point: str) -> dict[str, Any] | None:
    """A point's prediction as the record holds it: for a step whose program the code no
    longer makes (pp's tick engine changed after an H100 measured it), predicted then from
    the program measured."""
    path = GPU / "h100_target_time.json"
    if not path.exists():
        return None
    found = [p for p in json.loads(path.read_text())["points"] if p["point"] == point]
    return found[0] if found else None


def _engine(record: dict[str, Any], contender: str) -> Callable[[], Any]:
    def compiled() -> Any:
        sys.path.insert(0, str(HERE))
        import pipeline_engine

        import shardplug
        from shardplug.core.compiled.targets import compile_noting, target_devices

        llama = pipeline_engine.llama_example()
        config = dataclasses.replace(llama.Config(), **pipeline_engine.SIZES[record["size"]],
                                     batch=record["batch"], remat="none")  # fmt: skip
        task = llama.task_of(config, f"llama-{record['size']}")
        how = pipeline_engine.contenders(record["microbatches"])[contender]
        strategy = how["strategy"]
        if isinstance(strategy, tuple):
            strategy = shardplug.get_strategy(strategy[0], **strategy[1])
        trainer = task.trainer(
            strategy=strategy, devices=target_devices("h100", 1),
            mesh="stage=1" if contender.startswith("pp") else None,
            grad_accum=how.get("grad_accum", 1), precision="bf16", allocate=False,
        )  # fmt: skip
        compile_noting(trainer, next(itertools.islice(task.batches(), 1)))
        return trainer.compiled

    return compiled


def fit(texts: dict[str, str], measured: dict[str, float]) -> dict[str, float]:
    """Each constant of :data:`FIT` solved on its one point (the others held), in turns until
    they settle: the predicted seconds fall as an efficiency rises, so a bisection finds it."""
    from shardplug.core.compiled.timing import CHIPS, predict

    constants = {name: getattr(CHIPS["h100"], name) for name in FIT}
    for _ in range(4):
        for name, point in FIT.items():
            low, high = 0.3, 1.0
            for _ in range(30):
                constants[name] = (low + high) / 2
                chip = dataclasses.replace(CHIPS["h100"], **constants)
                if predict(texts[point], chip).seconds > measured[point]:
                    low = constants[name]
                else:
                    high = constants[name]
    return {k: round(v, 4) for k, v in constants.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        parser.error(f"--out {args.out}: give a file in an existing folder")
    from shardplug.core.compiled.targets import on_cpu_alone

    on_cpu_alone()  # before JAX starts its backends
    import jax

    from shardplug.core.compiled.timing import CHIPS, predict, program_text

    found = points()
    frozen = {p["point"]: p["frozen"] for p in found if p.get("frozen")}
    texts = {p["point"]: program_text(p["compile"]()) for p in found if p["point"] not in frozen}
    measured = {p["point"]: p["measured_seconds"] for p in found}
    constants = fit(texts, measured)
    chip = dataclasses.replace(CHIPS["h100"], **constants)
    rows = []
    for p in found:
        if p["point"] in frozen:  # predicted from the program measured, when it was made
            rows.append({**frozen[p["point"]], "frozen": True})
            continue
        step = predict(texts[p["point"]], chip)
        rows.append({
            "point": p["point"], "file": p["file"], "measured_seconds": p["measured_seconds"],
            "predicted_seconds": step.seconds,
            "error": step.seconds / p["measured_seconds"] - 1,
            "in_fit": p["point"] in FIT.values(),
            "parts_seconds": {k: round(v["seconds"], 6) for k, v in step.parts.items()},
        })  # fmt: skip
    held = [abs(r["error"]) for r in rows if not r["in_fit"]]
    result = {
        "target": "h100", "jax": jax.__version__, "fitted": constants,
        "fitted_on": FIT, "worst_held_out_error": max(held) if held else None,
        "mean_held_out_error": math.fsum(held) / len(held) if held else None,
        "points": rows,
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    from shardplug.errors import ShardplugError

    try:
        main()
    except ShardplugError as exc:  # no CUDA plugin, JAX started on a GPU: one line
        sys.exit(print(f"target_time: error: {exc}", file=sys.stderr) or 2)
