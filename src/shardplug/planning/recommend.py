"""Which strategy to use: every installed strategy and composition compiled, then ranked.

The policy, written once. On more than one device a strategy that divides nothing (the
batch and every parameter whole on every device: each device doing all the work) is not a
candidate. Of those whose peak memory per device fits, prefer those whose traffic is all
parameters and gradients (the textbook collectives, which overlap with compute and do not
grow with the batch) over those that also move activations (tensor parallelism's
all-reduces, on the critical path of every layer); then the fewest bytes sent per device per
step, bytes within 5% of the least counting as equal; of equals, the plainest step; then the
lower peak. A pick that splits the sequence (cp) is planned under each of cp's schemes, and
takes the one that fits and sends the least (then of lower peak): the all-to-all sends a
layer's activations once, whatever the length, where heads divide its devices; the ring
holds the least. The plainest step: no pipeline schedule, no parallelism that computes one of the
model's operations its own way (a ring attention, routed experts: they are there for what
they make fit, not for a tie), the single-program (``jit``) strategies before one that runs
its own program (``pmap``), the fewest parallelisms. A strategy is never preferred by its
name: data parallelism wins where it fits because its one gradient all-reduce is the least
such traffic, and loses where it does not fit. On one device nothing is sent: the plainest
step that fits wins, of peaks within 5% of the lowest.

Where the devices are a GPU shardplug predicts (``--target h100``, or an H100 present), the
policy is the step's predicted time instead (:func:`shardplug.predict_step`, which weighs
what the rest only counts: each kernel's FLOPs and bytes, each collective over its link and
how much of it the schedule hides): the fastest that fits, times within 2% counting as equal
(of equals, the plainest step); a pipeline's schedule and cp's scheme likewise. The reason
names the runner-up and how much longer its step takes.

A parameter the step uses twice (an embedding tied to the output) has a gradient of two
parts; XLA's CPU compiler (planning on a CPU for a GPU) all-reduces each apart, and its GPU
compiler adds them and reduces once. The parts are gradients, not activations (the textbook figure
counts them, :func:`shardplug.core.compiled.hlo.gradient_parts`), and bytes are compared with each
gradient reduced once, as the GPU sends them: ``dp`` then sends what ``pmap`` does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from shardplug.core.registry import list_strategies
from shardplug.core.units import size
from shardplug.errors import ShardplugError
from shardplug.planning.explain import explain
from shardplug.planning.longest import longest_sequences  # its home before: kept importable here


def candidates() -> list[str]:
    """Every installed strategy, parallelism and named composition, then every composition of
    two or more installed parallelisms that no installed name already stands for."""
    infos = list_strategies()
    names = [i.name for i in infos]
    covered = {frozenset((i.parts or i.name).split("+")) for i in infos}
    parallelisms = [i.name for i in infos if i.kind == "parallelism"]
    for count in range(2, len(parallelisms) + 1):
        for combo in itertools.combinations(parallelisms, count):
            if frozenset(combo) not in covered:
                names.append("+".join(combo))
    return names


def _plainness(name: str, infos: dict[str, Any]) -> tuple[int, int, int]:
    """``(parallelisms computing a model operation their own way, runs its own program,
    parallelisms)`` of a strategy, read from the registry's ``infos``: lower is plainer."""
    info = infos.get(name)
    parts = (info.parts if info is not None and info.parts else name).split("+")
    found = [infos[p] for p in parts if p in infos]
    replacing = sum("operations" in i.hooks for i in found)
    own_program = sum(i.kind == "strategy" for i in found)
    return replacing, own_program, len(parts)


def _divides(trainer: Any) -> bool:
    """Whether the strategy splits anything over the mesh: a parameter or the batch."""
    import jax

    def split(sharding: Any) -> bool:
        spec = getattr(sharding, "spec", None)
        if spec is None:  # not a NamedSharding (a per-device program's): its own devices
            return len(getattr(sharding, "device_set", ())) > 1 and not sharding.is_fully_replicated
        axes = [a for entry in spec if entry is not None
                for a in (entry if isinstance(entry, tuple) else (entry,))]  # fmt: skip
        return any(trainer.mesh.shape[a] > 1 for a in axes)

    placed = jax.tree.leaves(trainer.batch_shardings)  # as the compiled step laid it out
    return any(map(split, placed)) or any(map(split, jax.tree.leaves(trainer.param_shardings)))


def recommend(
    compile_trainer: Callable[[str], tuple[Any, Any]],
    device_memory: int,
    strategies: list[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Rank ``strategies`` (default :func:`candidates`) for one model and device memory.

    :param compile_trainer: ``name -> (trainer, batch)`` for the user's model; a strategy
        whose trainer cannot be built here (a mesh that does not fit the devices, say) is
        listed with its error.
    :param progress: called ``(i, count, name)`` before candidate ``i`` (from 0) compiles,
        and ``(count, count, "")`` when all have.
    :return: ``{"strategies": [row per strategy], "recommended": name or None, "reason"}``.
    """
    names = strategies or candidates()
    rows = []
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        rows.append(_row(compile_trainer, name, {}, device_memory))
    if progress is not None:
        progress(len(names), len(names), "")
    # A pipeline is planned under each schedule where one is the pick, or where nothing fits
    # (another schedule may hold less): the one of least bubble that fits, then least peak.
    best = _best(rows)
    if best is None:
        planned = [r for r in rows if r.get("pipelined")]
    else:
        planned = [best] if best["pipelined"] else []
    for row in planned:
        _schedule_for(row, compile_trainer, device_memory)
    best = _best(rows)
    if best is not None:  # a pick that splits the sequence: under each of cp's schemes
        _scheme_for(best, compile_trainer, device_memory)

    fitting = sorted((r for r in rows if r["fits"]), key=_rank)
    if not fitting:
        return _offloaded(rows, compile_trainer, device_memory)
    best, equals = _best(rows, with_equals=True)
    infos = {i.name: i for i in list_strategies()}
    others = [r["strategy"] for r in rows if "error" not in r and not r["fits"]]
    if _timed(fitting):
        reason = _fastest(best, fitting, equals, device_memory)
    elif math.prod(best["mesh"].values()) == 1:
        # One device: nothing is split or sent, so the plain step is best; a pipeline
        # schedule on one stage only cuts the batch into microbatches (slower, less memory).
        low = min(r["peak_bytes"] for r in fitting)  # peaks within 5% are equal
        best = min(fitting, key=lambda r: (_plain(r, infos), r["peak_bytes"] > 1.05 * low,
                                           r["peak_bytes"]))  # fmt: skip
        reason = (
            f"one device: no strategy splits or sends anything, and of the {len(fitting)} that "
            f"fit it is the plainest step (peak {size(best['peak_bytes'])} of "
            f"{size(device_memory)}); it runs unchanged on more devices"
        )
    else:
        what = (
            "moves parameters and gradients only, and the least of them"
            if _rank(best)[0] is False
            else "moves activations too (every strategy that fits does), and sends the least"
        )
        parts = (
            f" ({size(best['parts_bytes'])} of it a shared parameter's gradient reduced in "
            "parts, as XLA's CPU compiler does and its GPU compiler does not: compared without)"
            if best["parts_bytes"] else ""
        )  # fmt: skip
        reason = (
            f"of the {len(fitting)} that fit, it {what}: {size(best['sent_bytes'])} per device "
            f"per step in {best['collectives']} collective(s){parts}, at a peak of "
            f"{size(best['peak_bytes'])} of {size(device_memory)}"
        )
        tied = [r["strategy"] for r in equals if r is not best]
        if tied:
            reason += f"; the plainest step of those sending as little ({', '.join(tied)})"
    if others:
        reason += f"; {', '.join(others)} do not fit"
    chosen, scheme = best.get("schedule"), best.get("scheme")
    options = {}
    for plan, key in ((chosen, "schedule"), (scheme, "cp.scheme")):
        if plan is not None:
            reason += f"; {plan['reason']}"
            options[key] = plan["name"]
    addons = _float8(best)
    if addons:
        reason += (
            f"; the {best['device_kind']} multiplies float8: add --addon float8 to run "
            f"the linear layers' products in it (e4m3 forward, e5m2 gradients: "
            f"torchtitan measured 1.28x the tokens a second at 8B), the same memory"
        )
    result = {"strategies": rows, "recommended": best["strategy"], "reason": reason,
              "options": options, "addons": addons}  # fmt: skip
    result["runner_up"] = runner_up(result)
    return result


def _fastest(best: dict[str, Any], fitting: list[dict[str, Any]], equals: list[dict[str, Any]],
             device_memory: int) -> str:  # fmt: skip
    """Why the fastest predicted step was picked, and how much slower the runner-up is."""
    ms = best["predicted_seconds"] * 1e3
    reason = (f"of the {len(fitting)} that fit, its step is the fastest predicted on the GPU's "
              f"program: {ms:,.1f} ms" + (f" (MFU {best['mfu']:.1%})" if best.get("mfu") else "")
              + f", at a peak of {size(best['peak_bytes'])} of {size(device_memory)}")  # fmt: skip
    tied = [r["strategy"] for r in equals if r is not best]
    if tied:
        reason += f"; the plainest of those within {TIED - 1:.0%} of it ({', '.join(tied)})"
    others = sorted((r for r in fitting if r is not best), key=lambda r: r["predicted_seconds"])
    if others:
        second = others[0]
        reason += (
            f"; the runner-up, {second['strategy']}, takes "
            f"{second['predicted_seconds'] / best['predicted_seconds']:.2f}x as long"
        )
    return reason


def runner_up(result: dict[str, Any]) -> dict[str, Any] | None:
    """The fitting strategy predicted fastest after the pick, and its time over the pick's
    (None where times were not predicted or nothing else fits)."""
    rows = {r["strategy"]: r for r in result["strategies"] if r.get("fits")}
    best = rows.get(result.get("recommended") or "")
    if best is None or not _timed(list(rows.values())):
        return None
    others = sorted((r for r in rows.values() if r is not best),
                    key=lambda r: r["predicted_seconds"])  # fmt: skip
    if not others:
        return None
    return {
        "strategy": others[0]["strategy"],
        "ratio": others[0]["predicted_seconds"] / best["predicted_seconds"],
    }


def _float8(row: dict[str, Any]) -> list[str]:
    """``["float8"]`` where the pick computes in bf16 on devices that multiply float8 and
    does not already: the add-on recommend suggests beside it."""
    from shardplug.finetuning.float8 import FLOAT8_DEVICES

    wanted = row.get("bf16") and not row.get("float8")
    return ["float8"] if wanted and FLOAT8_DEVICES.search(row.get("device_kind", "")) else []


#: offload's forms recommend tries where nothing fits on the devices alone, least moved
#: first: the optimizer state on the host and updated there, then the parameters too
OFFLOADS = (
    ("the optimizer state in host memory, updated there", {"offload.update": "host"}),
    ("the optimizer state and the parameters in host memory",
     {"offload.update": "host", "offload.params": True}),
)  # fmt: skip


def _offloaded(rows: list[dict[str, Any]], compile_trainer: Callable[..., tuple[Any, Any]],
               device_memory: int) -> dict[str, Any]:  # fmt: skip
    """Where no strategy fits on the devices alone: each that ran and could fit with the
    ``offload`` add-on's forms in turn (:data:`OFFLOADS`: its peak, less what the form moves
    to the host, within the memory), the first form with one that fits ranked as the others
    are; or none."""
    ran = [r for r in rows if "error" not in r]
    for what, options in OFFLOADS:
        moved = ["opt_state_bytes", *(["params_bytes"] if "offload.params" in options else [])]
        could = [r["strategy"] for r in ran
                 if r["peak_bytes"] - sum(r[k] for k in moved) <= device_memory]  # fmt: skip
        tried = [_row(compile_trainer, f"{n}+offload", options, device_memory) for n in could]
        rows = [*rows, *tried]
        best = _best(tried)
        if best is not None:
            best["options"] = options
            reason = (
                f"nothing fits on the devices alone ({', '.join(r['strategy'] for r in ran)} do "
                f"not); with offload, "
                f"{what}, it peaks at {size(best['peak_bytes'])} of {size(device_memory)} "
                f"per device and sends {size(best['sent_bytes'])} per step"
            )
            return {"strategies": rows, "recommended": best["strategy"], "reason": reason,
                    "options": dict(options)}  # fmt: skip
    reason = (
        "no installed strategy fits, with offload or without: add devices, or shrink the "
        "batch or model"
    )
    return {"strategies": rows, "recommended": None, "reason": reason}


def _row(compile_trainer: Callable[..., tuple[Any, Any]], name: str, options: dict[str, Any],
         device_memory: int) -> dict[str, Any]:  # fmt: skip
    """A candidate compiled and explained: its figures, or why it cannot run here."""
    try:
        trainer, batch = compile_trainer(name, options) if options else compile_trainer(name)
        report = explain(trainer, batch, device_memory=device_memory)
    except ShardplugError as exc:  # a strategy that cannot run this model here
        return {"strategy": name, "fits": False, "error": str(exc)}
    devices = math.prod(trainer.mesh.shape.values())
    if devices > 1 and not _divides(trainer):
        return {"strategy": name, "fits": False, "error": (
            f"divides nothing here: the batch and every parameter are whole on each of "
            f"the {devices} devices, which would all do the same work")}  # fmt: skip
    peak = report.per_device["peak_bytes"]
    pipeline = report.pipeline or {}
    return {
        "strategy": name,
        "mesh": {str(k): int(v) for k, v in trainer.mesh.shape.items()},
        "fits": peak is not None and peak <= device_memory,
        "peak_bytes": peak,
        "params_bytes": report.per_device["params_bytes"],
        "opt_state_bytes": report.per_device["opt_state_bytes"],
        "sent_bytes": report.wire_bytes(),
        "parts_bytes": report.parts_wire_bytes(),  # sent of a shared gradient's further parts
        "activation_bytes": max(0, report.wire_bytes() - report.textbook_wire_bytes()),
        "collectives": sum(c["count"] for c in report.collectives),
        "pipelined": report.pipeline is not None,
        "device_kind": trainer.mesh.devices.flat[0].device_kind,
        "bf16": report.precision.get("compute") == "bfloat16",
        "float8": "float8" in trainer.strategy.addons,
        **({"bubble": pipeline["bubble"], "ran": pipeline["schedule"]} if pipeline else {}),
        **({"predicted_seconds": report.timing["seconds"], "mfu": report.timing["mfu"]}
           if report.timing else {}),
    }  # fmt: skip


def _rank(row: dict[str, Any]) -> tuple:
    """``(moves activations, bytes sent with each gradient reduced once, peak)``."""
    sent = row["sent_bytes"] - row["parts_bytes"]
    moves_activations = row["activation_bytes"] > 0.05 * sent
    return (moves_activations, sent, row["peak_bytes"])


#: predicted times within this factor of the fastest count as equal (the plainest wins)
TIED = 1.02


def _timed(rows: list[dict[str, Any]]) -> bool:
    """Whether every row has a predicted step time (a GPU's program): then they are ranked
    by it."""
    return bool(rows) and all(r.get("predicted_seconds") for r in rows)


def _best(rows: list[dict[str, Any]], with_equals: bool = False) -> Any:
    """The pick of the fitting rows (see the module), and those sending about as little (of
    predicted times, those within 2% of the fastest)."""
    infos = {i.name: i for i in list_strategies()}
    fitting = sorted((r for r in rows if r["fits"]), key=_rank)
    if not fitting:
        return (None, []) if with_equals else None
    if _timed(fitting):
        fastest = min(r["predicted_seconds"] for r in fitting)
        equals = [r for r in fitting if r["predicted_seconds"] <= TIED * fastest]
        best = min(equals, key=lambda r: (_plain(r, infos), r["predicted_seconds"]))
        return (best, equals) if with_equals else best
    least = fitting[0]
    equals = [r for r in fitting if _rank(r)[0] == _rank(least)[0]
              and _rank(r)[1] <= 1.05 * _rank(least)[1]]  # fmt: skip
    best = min(equals, key=lambda r: (_plain(r, infos), r["peak_bytes"]))
    return (best, equals) if with_equals else best


def _plain(row: dict[str, Any], infos: dict[str, Any]) -> tuple:
    """How plain a candidate's step is: no pipeline first, then :func:`_plainness`."""
    return (row["pipelined"], *_plainness(row["strategy"], infos))


def planned_schedules() -> list[str]:
    """The schedules recommend plans a pipeline under: gpipe and every installed schedule
    that runs one chunk a stage (those that need repeats plan other layer counts)."""
    from shardplug.strategies.pp.schedules import installed

    return ["gpipe", *(name for name, s in installed().items() if not s.chunked)]


def _schedule_for(row: dict[str, Any], compile_trainer, device_memory: int) -> None:
    """Plan ``row``'s pipeline under each schedule; where one that fits idles less than the
    one it ran (or fits where it did not), take its figures and record it."""
    from shardplug.core.registry import strategy_options

    if "schedule" not in {o.name for o in strategy_options(row["strategy"])}:
        return
    tried = {name: _row(compile_trainer, row["strategy"], {"schedule": name}, device_memory)
             for name in planned_schedules()}  # fmt: skip
    fits = {k: r for k, r in tried.items() if r["fits"] and "bubble" in r}
    if not fits:
        return
    if _timed(list(fits.values())):  # the fastest predicted step
        name = min(fits, key=lambda k: (fits[k]["predicted_seconds"], fits[k]["peak_bytes"]))
    else:
        name = min(fits, key=lambda k: (fits[k]["bubble"], fits[k]["peak_bytes"]))
    chosen = fits[name]
    figures = ", ".join(
        f"{k} {r['bubble']:.1%} idle at {size(r['peak_bytes'])}"
        + (f", {r['predicted_seconds'] * 1e3:,.1f} ms" if r.get("predicted_seconds") else "")
        if "bubble" in r else f"{k} refused" for k, r in tried.items()
    )  # fmt: skip
    over = [k for k, r in tried.items() if "bubble" in r and not r["fits"]]
    least = "the fastest predicted" if _timed(list(fits.values())) else "the least idle"
    reason = (f"-o pp.schedule={name}: {least} of the schedules that fit ({figures}"
              + (f"; {', '.join(over)} do not fit" if over else "") + ")")  # fmt: skip
    row.update({k: v for k, v in chosen.items() if k != "strategy"})
    row["schedule"] = {"name": name, "reason": reason, "tried": {
        k: {"bubble": r.get("bubble"), "peak_bytes": r.get("peak_bytes"), "fits": r["fits"]}
        for k, r in tried.items()}}  # fmt: skip


#: cp's schemes, as recommend plans a pick that splits the sequence under each
PLANNED_SCHEMES = ("ring", "gather", "ulysses", "hybrid")


def _scheme_for(row: dict[str, Any], compile_trainer, device_memory: int) -> None:
    """Plan ``row`` (a strategy with cp) under each of cp's schemes; of those that fit, the
    one that sends the least (within 5%: equal), then of lower peak; its figures taken, and
    why recorded (each scheme's bytes and peak, or why it cannot run)."""
    from shardplug.core.registry import strategy_options

    if "scheme" not in {o.name for o in strategy_options(row["strategy"])}:
        return
    if row["mesh"].get("context", 1) == 1 or row["pipelined"]:
        return  # one context device, or attention inside a pipeline's stage (gathered): the
        # schemes are one program
    tried = {name: _row(compile_trainer, row["strategy"], {"scheme": name}, device_memory)
             for name in PLANNED_SCHEMES}  # fmt: skip
    fits = {k: r for k, r in tried.items() if r["fits"]}
    if not fits:
        return
    if _timed(list(fits.values())):  # the fastest predicted step, then the lowest peak
        fastest = min(r["predicted_seconds"] for r in fits.values())
        equal = {k: r for k, r in fits.items() if r["predicted_seconds"] <= TIED * fastest}
    else:
        least = min(r["sent_bytes"] - r["parts_bytes"] for r in fits.values())
        equal = {k: r for k, r in fits.items()
                 if r["sent_bytes"] - r["parts_bytes"] <= 1.05 * least}  # fmt: skip
    name = min(equal, key=lambda k: (equal[k]["peak_bytes"], PLANNED_SCHEMES.index(k)))

    def said(k: str, r: dict[str, Any]) -> str:
        if "error" in r:
            return f"{k} cannot run here ({r['error']})"
        return (f"{k} sends {size(r['sent_bytes'])} at {size(r['peak_bytes'])}"
                + (f", {r['predicted_seconds'] * 1e3:,.1f} ms" if r.get("predicted_seconds")
                   else "") + ("" if r["fits"] else ", over"))  # fmt: skip

    timed = _timed(list(fits.values()))
    why = (("is the fastest predicted" if timed else "sends the least") if len(equal) == 1
           else f"has the lowest peak of those {'as fast' if timed else 'sending as little'} "
                f"({', '.join(equal)})")  # fmt: skip
    reason = (f"-o cp.scheme={name}: of cp's schemes that fit, it {why} ("
              + "; ".join(said(k, r) for k, r in tried.items()) + ")")  # fmt: skip
    row.update({k: v for k, v in tried[name].items() if k != "strategy"})
    row["scheme"] = {"name": name, "reason": reason, "tried": {
        k: {"sent_bytes": r.get("sent_bytes"), "peak_bytes": r.get("peak_bytes"),
            "fits": r["fits"], **({"error": r["error"]} if "error" in r else {})}
        for k, r in tried.items()}}  # fmt: skip


__all__ = ["candidates", "longest_sequences", "recommend"]
