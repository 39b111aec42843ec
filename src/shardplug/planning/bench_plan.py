"""``bench --plan``: strategies and their hand-written twins compiled for a GPU that is not
here (``target_devices``) and compared by their steps' predicted times, nothing run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardplug.core.memory import peak_bytes
from shardplug.core.registry import get_strategy
from shardplug.errors import ConfigError
from shardplug.planning.bench import _check_benchable, _first_batches, _HandWritten


def plan(strategies: Sequence[str], task: Any, devices: list[Any],
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """``bench --plan``: each strategy and its hand-written twin compiled for ``devices``
    (a GPU's, compile-only: ``target_devices``) and their steps predicted from the programs
    (:func:`shardplug.predict_step`), nothing allocated or run; ranked fastest first. Both
    compute in float32 (TF32 products on an NVIDIA GPU), as ``bench`` compares them: the
    hand-written twin is the plain step a user writes.

    :return: ``{"plans": [{"strategy", "predicted_seconds", "hand_written_seconds",
        "ratio", "tokens_per_second", "mfu", "peak_bytes"}...] (fastest first),
        "runner_up": {"strategy", "ratio"} or None}``.
    """
    from shardplug.core.compiled.targets import as_present, compile_noting
    from shardplug.core.compiled.timing import predict_step
    from shardplug.planning.explain_time import predicted

    _check_benchable(strategies)
    first = _first_batches(task)[0]
    say = progress or (lambda _: None)
    rows = []
    for strategy in strategies:
        say(f"compiling {strategy} and its twin")
        trainer = task.trainer(strategy=get_strategy(strategy), devices=devices,
                               allocate=False, precision="float32")  # fmt: skip
        compile_noting(trainer, first)
        ours = predicted(trainer, first)
        if ours is None:
            raise ConfigError(
                f"bench --plan predicts a GPU's step from its program; {devices[0].platform} "
                "devices have no figures to predict with: give --target h100 (or h200, a100)"
            )
        with as_present(trainer.mesh.devices.flat[0]):
            twin = _HandWritten("twin", "hand-written", trainer, task, first, 1, None).compiled
        theirs = predict_step(twin).seconds
        rows.append({
            "strategy": strategy, "predicted_seconds": ours["seconds"],
            "hand_written_seconds": theirs, "ratio": ours["seconds"] / theirs,
            "tokens_per_second": ours["tokens_per_second"], "mfu": ours["mfu"],
            "peak_bytes": peak_bytes(trainer.compiled.memory_analysis(),
                                     trainer.compiled.as_text()),
        })  # fmt: skip
    rows.sort(key=lambda r: r["predicted_seconds"])
    runner = None
    if len(rows) > 1:
        runner = {"strategy": rows[1]["strategy"],
                  "ratio": rows[1]["predicted_seconds"] / rows[0]["predicted_seconds"]}  # fmt: skip
    return {"model": task.name, "devices": len(devices), "device": devices[0].device_kind,
            "plans": rows, "runner_up": runner}  # fmt: skip
