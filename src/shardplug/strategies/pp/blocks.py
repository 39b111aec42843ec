"""What pp says of a model without a layer stack it can split, read from the parameters'
paths and shapes: the blocks libraries write as a Python list (``layer_0``, ``blocks.0``,
``blocks/0``), of one structure or of several kinds, or stacked layers the model applies with
its own loop (a ``lax.scan`` over leaves sharing a leading dimension).

Each diagnosis is one line ending in the smallest change that makes the model run under
pp: holding the blocks as one :mod:`shardplug.stack` and calling it once in place of the loop.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any

_NUMBERED = re.compile(r"^(?P<base>.*?)[._](?P<index>\d+)$")
STACK_HELPERS = (
    "shardplug.stack: nnx_layers and apply in NNX, LinenLayers in Linen, equinox_layers and "
    "apply in Equinox"
)


@dataclasses.dataclass(frozen=True)
class BlockList:
    """A Python list of blocks among the parameters: its name as a path prefix, its members'
    names in order, and each member's kind (members of one kind have one structure)."""

    name: str
    members: tuple[str, ...]
    kinds: tuple[int, ...]
    kind_names: tuple[str, ...]

    def period(self) -> int:
        """The fewest blocks after which the kinds repeat, dividing the list (its length
        when they never do)."""
        n, kinds = len(self.kinds), self.kinds
        periodic = (p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
        return next(periodic)

    def span(self) -> str:
        return f"{self.members[0]} ... {self.members[-1]}"


def block_list(paths: list[str], leaves: list[Any]) -> BlockList | None:
    """The longest list of numbered sibling blocks (two or more, each holding layers of its
    own, not arrays: ``layer_0/attn/q``, not ``Dense_0/kernel``) among ``paths``, outermost
    among equals; None when the parameters hold none."""
    lists: dict[str, dict[int, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    labels: dict[tuple[str, int], str] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        parts = path.split("/")
        for i, part in enumerate(parts):
            found = _NUMBERED.match(part)
            if part.isdigit() and i > 0:
                name, index, label = "/".join(parts[:i]), int(part), "/".join(parts[: i + 1])
            elif found:
                name = "/".join([*parts[:i], found["base"]])
                index, label = int(found["index"]), "/".join(parts[: i + 1])
            else:
                continue
            rest = "/".join(parts[i + 1 :])
            lists[name][index][rest] = (tuple(leaf.shape), str(leaf.dtype))
            labels[(name, index)] = label
    best = None
    for name, members in lists.items():
        if len(members) < 2 or sorted(members) != list(range(len(members))):
            continue
        if not all("/" in rest for m in members.values() for rest in m):
            continue  # layers holding arrays (Linen's Dense_0, Dense_1 in a block): no blocks
        key = (len(members), -name.count("/"))
        if best is None or key > best[0]:
            best = (key, name, members)
    if best is None:
        return None
    _, name, members = best
    shapes = [frozenset(members[i].items()) for i in range(len(members))]
    kinds_seen: list[frozenset] = []
    for s in shapes:
        if s not in kinds_seen:
            kinds_seen.append(s)
    kinds = tuple(kinds_seen.index(s) for s in shapes)
    return BlockList(name, tuple(labels[(name, i)] for i in range(len(members))), kinds,
                     _kind_names(kinds_seen))  # fmt: skip


def _kind_names(kinds: list[frozenset]) -> tuple[str, ...]:
    """Each kind by the child of its blocks that only it has (``recurrent_block``,
    ``attention_block``), else by its place."""
    children = [{rest.split("/")[0] for rest, _ in kind} for kind in kinds]
    names = []
    for i, own in enumerate(children):
        others = set().union(*(c for j, c in enumerate(children) if j != i))
        only = sorted(own - others)
        names.append(only[0] if only else f"kind {i + 1}")
    return tuple(names)


def stacked_child(paths: list[str], leaves: list[Any]) -> tuple[str, int] | None:
    """A child of the model whose leaves (two or more, each of two dimensions or more: a
    stacked bias too) share a leading dimension of two or more: layers stacked by the model
    itself (``eqx.filter_vmap`` of a block), ``(name, layers)``; None when there is none."""
    groups: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for path, leaf in zip(paths, leaves, strict=True):
        if "/" in path:
            groups[path.split("/")[0]].append(tuple(leaf.shape))
    for name, shapes in groups.items():
        firsts = {s[0] if len(s) >= 2 else 0 for s in shapes}
        if len(shapes) >= 2 and len(firsts) == 1 and min(firsts) >= 2:
            return name, firsts.pop()
    return None


def listed(paths: list[str], leaves: list[Any], named: list[bool]) -> str | None:
    """Why leaves a rule named ``layers`` (``named``) inside the blocks of a list are no layer
    stack (each block's own first dimension); None where they are not in one."""
    found = block_list(paths, leaves)
    if found is None:
        return None
    ours = [p for p, n in zip(paths, named, strict=True) if n]
    members = {m for m in found.members if any(p.startswith(m + "/") for p in ours)}
    inside = all(any(p.startswith(m + "/") for m in found.members) for p in ours)
    if len(members) < 2 or not inside:  # a stack's own children (LayerNorm_0, _1): a stack
        return None
    return (
        f"the rules name the first dimension of each of {found.span()} 'layers', but those "
        f"are {len(found.members)} separate blocks of a list, not a layer stack: "
        f"{_about_list(found)}"
    )


def no_stack(axis: str, paths: list[str], leaves: list[Any]) -> str:
    """Why a model with no layer stack cannot be split over ``axis``, and what to change."""
    head = f"pp splits a layer stack over {axis!r}, and this model has none"
    found = block_list(paths, leaves)
    if found is not None:
        return f"{head}: {_about_list(found)}"
    stacked = stacked_child(paths, leaves)
    if stacked is not None:
        name, layers = stacked
        return (
            f"pp splits a layer stack over {axis!r}, and this model names none: it stores "
            f"{layers} layers stacked under {name}/ (each leaf's first dimension {layers}): "
            f"name that dimension in the adapter's rules, rules={{r'{name}/.*': ('layers',)}}, "
            f"and apply them with shardplug.stack (shardplug.stack.scan(block, {name}, x) in "
            f"place of a lax.scan of the model's own)"
        )
    return (
        f"{head}: build its blocks with {STACK_HELPERS}; Equinox blocks, and Linen blocks "
        f"without sharding annotations, also name the stack's leading dimension in the "
        f"adapter's rules, e.g. rules={{r'blocks/.*': ('layers',)}}"
    )


def _about_list(found: BlockList) -> str:
    n, kinds = len(found.members), len(found.kind_names)
    if kinds == 1:
        return (
            f"its blocks are a Python list of {n} of one structure ({found.span()}), called "
            f"one by one: hold them as one stack and call it once in place of the loop "
            f"({STACK_HELPERS})"
        )
    where = " and ".join(
        f"{name} ({', '.join(str(i) for i, k in enumerate(found.kinds) if k == kind)})"
        for kind, name in enumerate(found.kind_names)
    )
    p = found.period()
    said = f"its blocks are a Python list of {n} ({found.span()}) of {kinds} kinds: {where}"
    if p < n:
        cycle = ", ".join(found.kind_names[k] for k in found.kinds[:p])
        return (
            f"{said}; the kinds repeat every {p} blocks ({cycle}), so a stack of {n // p} "
            f"blocks, each one period of {p}, runs under pp ({STACK_HELPERS})"
        )
    return (
        f"{said}, which do not repeat in whole periods: a layer stack holds blocks of one "
        f"structure, so pp cannot split this list; leave pp out (fsdp and tp split it as it is)"
    )


def undivided(size: int, repeats: int, layers: int) -> str:
    """A layer stack of ``layers`` that ``size`` stages x ``repeats`` do not divide."""
    what = f"{size} stages" if repeats == 1 else f"{size} stages x {repeats} chunks each"
    return (
        f"{what} do not divide the layer stack's {layers} layers: choose a layer count that "
        f"is a multiple of {size * repeats} (--layers), or another stage count "
        f"(--mesh stage=N)"
    )
