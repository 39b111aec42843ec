"""What a compiled step sends next to the textbook, for :func:`shardplug.planning.explain.explain`.

The textbook's collectives for the strategy's layout, the gradients the compiled step
all-reduces in parts, and the notes where the compiled program and the textbook part ways.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import NamedSharding

from shardplug.core.compiled.hlo import gradient_parts, textbook_collectives
from shardplug.core.sharding import mesh_axes
from shardplug.core.units import size


def tensor_parallel_notes(used: list[Any], mesh: Any, batch_axes: tuple[str, ...]) -> list[str]:
    """That the textbook leaves out the activation collectives of parameters used split over
    axes the batch is not split over (``used``: each parameter's spec where it is used; an
    axis lent to store them only is gathered, and is no tensor parallelism)."""
    tensor_parallel = {a for spec in used for a in mesh_axes(spec) if a not in batch_axes}
    if not tensor_parallel:
        return []
    return [
        f"parameters split over {sorted(tensor_parallel)}, which the batch is not split "
        "over (tensor parallelism), need activation collectives forward and backward "
        "that the model's code decides; the textbook figure leaves them out"
    ]


def textbook_and_parts(
    hlo_text: str,
    found: list[dict[str, Any]],
    params: list[Any],
    paths: list[str],
    trains: list[bool],
    *,
    shards: list[int],
    stored: list[Any],
    used: list[Any],
    mesh: Any,
    batch_axes: tuple[str, ...],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """The textbook's collectives for the layout, counting a gradient reduced in parts once a
    part; the gradient parts the compiled step reduces, by parameter path; and their notes.

    :param found: the compiled step's collectives.
    :param shards: each parameter's bytes per device; ``stored`` and ``used``: its spec as
        stored and where it is used.
    :return: ``(textbook, gradient parts, notes)``.
    """
    notes = []
    parts = _gradient_parts(hlo_text, params, used, mesh, batch_axes)
    counts = [1 if t else 0 for t in trains]  # a frozen parameter's gradient: none
    for group in parts:  # of parameters alike, which one is shared cannot be seen: the first
        counts[group["params"][0]] += group["parts"] - len(group["params"])
        group["params"] = [paths[i] for i in group["params"]]
        notes.append(_parts_note(group))
    textbook = textbook_collectives(shards, stored, used, mesh, batch_axes, counts)
    kinds = {c["kind"] for c in found}
    if "reduce-scatter" in {t["kind"] for t in textbook} - kinds:
        notes.append(
            "the compiler reduces the gradients of split parameters with an all-reduce "
            "(each device then keeps its shard), and may gather a parameter outside a layer "
            "stack once for forward and backward: 1 all-gather + 1 all-reduce sends what 2 "
            "all-gathers + 1 reduce-scatter send"
        )
    return textbook, parts, notes


def _gradient_parts(hlo_text: str, params: list[Any], used: list[Any], mesh: Any,
                    batch_axes: tuple[str, ...]) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`shardplug.core.compiled.hlo.gradient_parts` of the step: each parameter's dimensions
    where it is used, and the batch devices its gradient is reduced over (those of the batch
    axes it is whole on there)."""
    dims, groups = [], []
    for p, spec in zip(params, used, strict=True):
        dims.append(tuple(NamedSharding(mesh, spec).shard_shape(tuple(p.shape))))
        local = set(mesh_axes(spec))
        groups.append(math.prod(mesh.shape[a] for a in batch_axes if a not in local))
    return gradient_parts(hlo_text, dims, groups)


def _parts_note(group: dict[str, Any]) -> str:
    params, dims = group["params"], "x".join(map(str, group["dims"]))
    which = (
        f"the gradient of {params[0]} ({dims}) is"
        if len(params) == 1
        else f"the gradients of the {len(params)} parameters of {dims} ({', '.join(params[:2])}"
        f"{f' and {len(params) - 2} more' if len(params) > 2 else ''}) are"
    )
    return (
        f"{which} all-reduced in {group['parts']} parts of that size "
        f"(+{size(group['extra_wire_bytes'])} sent): a parameter the step uses more than once "
        "(an embedding tied to the output) has a gradient part per use, which XLA's CPU "
        "compiler reduces one by one (its GPU compiler adds them first and reduces once); "
        "the textbook figure counts the parts"
    )
