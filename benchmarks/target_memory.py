"""The H100's program compiled on a CPU machine, against what an H100 measured.

``python benchmarks/target_memory.py`` compiles the GPT of ``benchmarks/gpu_mfu.py`` for one
H100 that is not present (``explain --target h100``: JAX's CUDA plugin, ``JAX_PLATFORMS=cpu``,
``pip install 'shardplug[target]'``), plain and under ``offload``, and prints one JSON object:
each case's predicted device peak, host bytes and host copies, next to the peak the H100
measured for the same step where ``benchmarks/gpu/`` holds one (``h100_mfu_SIZE.json``,
written by ``gpu_mfu.py`` on the GPU; the offload cases by ``benchmarks/gpu/check.sh``).
``--out FILE`` writes it too (``benchmarks/gpu/h100_target_memory.json``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).parent
#: (size, addons, offload's options) of each case
CASES = {
    "125m": ("125m", [], {}),
    "350m": ("350m", [], {}),
    "1b": ("1b", [], {}),
    "1b-offload": ("1b", ["offload"], {}),
    "1b-offload-params": ("1b", ["offload"], {"offload.params": True}),
}


def measured(size: str, addons: list[str], options: dict[str, Any]) -> int | None:
    """The peak an H100 measured for this step, where benchmarks/gpu/ holds one."""
    name = "-".join([size, *addons, *(k.split(".")[-1] for k in options)])
    for path in (HERE / "gpu" / f"h100_mfu_{size}.json", HERE / "gpu" / f"h100_{name}.json"):
        if path.exists():
            found = json.loads(path.read_text())
            if found.get("addons", []) == addons and found.get("remat", "none") == "none":
                return found.get("measured_peak_bytes")
    return None


def predict(case: str) -> dict[str, Any]:
    import shardplug
    from shardplug.core.compiled.targets import host_copies, target_devices
    from shardplug.planning.explain import explain

    sys.path.insert(0, str(HERE))
    import gpu_mfu

    size, addons, options = CASES[case]
    t = gpu_mfu.task(size)
    trainer = shardplug.Trainer(
        t.adapter, loss_fn=t.loss_fn, optimizer=t.optimizer,
        strategy=shardplug.get_strategy("dp", addons=addons, **options),
        devices=target_devices("h100", 1), allocate=False, precision="bf16",
    )  # fmt: skip
    batch = gpu_mfu.batches(gpu_mfu.SIZES[size], gpu_mfu.SIZES[size].batch, 1)[0]
    report = explain(trainer, batch)
    mem = report.per_device
    copies, overlapping, first = host_copies(trainer.compiled.as_text())
    row = {
        "case": case, "size": size, "batch": gpu_mfu.SIZES[size].batch, "addons": addons,
        "options": options, "predicted_peak_bytes": mem["peak_bytes"],
        "host_bytes": mem["host_bytes"], "update_bytes": mem["update_bytes"],
        "host_copies": copies, "copies_in_backward": overlapping,
        "first_copy_at": round(first, 3),
    }  # fmt: skip
    real = measured(size, addons, options)
    if real is not None:
        row["measured_peak_bytes"] = real
        row["predicted_over_measured"] = mem["peak_bytes"] / real
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="which (default: all)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: no case {unknown[0]!r}; choose from {', '.join(CASES)}")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        parser.error(f"--out {args.out}: give a file in an existing folder")
    from shardplug.core.compiled.targets import on_cpu_alone

    on_cpu_alone()  # before JAX starts its backends
    import jax

    rows = [predict(case) for case in args.cases.split(",")]
    result = {"target": "h100", "jax": jax.__version__, "cases": rows}
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
        sys.exit(print(f"target_memory: error: {exc}", file=sys.stderr) or 2)
