"""Weights an add-on holds: their products run its way (float8's), the model's code unchanged.

An add-on names the weights (the ``held_weights`` hook: one :class:`Hold` per leaf); the
training step marks each where its forward pass reads it (:func:`held`: a ``jax.jit`` named
for the hold; a layer stack's weight a layer at a time, inside its loop) and rewrites the
forward pass (:mod:`shardplug.core.operations.rewrite`): a mark's output stays a :class:`Held`
value,
casts, layouts and transposes apply to it, and each product by it runs the rule the add-on
registered for its hold's ``kind`` (:data:`RULES`). Anything else that reads the weight (a
reshape, a grouped product) reads it as it is, said once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from shardplug.core.operations.layer_gather import follow, made_by_layer, made_in_a_loop
from shardplug.core.operations.rewrite import MAKERS, Kept
from shardplug.errors import warn_once

#: the name of a hold's ``jax.jit``, followed by its number among :data:`_HOLDS`
HOLD = "shardplug_held_weight_"
#: a hold's kind -> a product's primitive name -> ``rule(eqn, ins, at, hold)``: the product
#: with its input ``at`` a :class:`Held` (None: it runs as it was)
RULES: dict[str, dict[str, Callable[..., Any]]] = {}


@dataclasses.dataclass(frozen=True)
class Hold:
    """The weight at ``path`` is held for the products of ``kind`` (a key of :data:`RULES`),
    with the rule's ``options`` (name, value pairs)."""

    path: str
    kind: str
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


_HOLDS: list[Hold] = []
_MARK_OF: dict[Hold, Callable[[Any], Any]] = {}


def hold(site: Hold) -> Callable[[Any], Any]:
    """The identity, as one ``jax.jit`` call named for ``site``: what the rewrite finds."""
    if site not in _MARK_OF:
        number = len(_HOLDS)
        _HOLDS.append(site)

        def held_weight(w):
            return w

        held_weight.__name__ = held_weight.__qualname__ = f"{HOLD}{number}"
        _MARK_OF[site] = jax.jit(held_weight)
    return _MARK_OF[site]


@dataclasses.dataclass(frozen=True)
class Held(Kept):
    """A held weight through the rewrite: its ``value`` and its :class:`Hold`."""

    value: Any
    site: Hold

    def parts(self) -> list[Any]:
        return [self.value]

    def again(self, parts: list[Any]) -> Held:
        return dataclasses.replace(self, value=parts[0])

    def whole(self, where: str) -> Any:
        warn_once(
            f"{self.site.kind}: the model's {where} reads {self.site.path}'s weight, so the "
            f"product after it runs as it was, not in {self.site.kind}"
        )
        return self.value

    def laid(self, fn: Callable[[Any], Any]) -> Held:
        return self.again([fn(self.value)])

    def transposed(self, permutation: tuple[int, ...], fn: Callable[[Any], Any]) -> Held:
        return self.again([fn(self.value)])

    def specs(self, spec: Any) -> list[Any]:
        return [spec]

    def rules(self) -> dict[str, Callable[[Any, list[Any], int], Any | None]]:
        return {name: functools.partial(rule, hold=self.site)
                for name, rule in RULES.get(self.site.kind, {}).items()}  # fmt: skip


MAKERS[HOLD] = lambda number, ins: Held(ins[0], _HOLDS[number])


def held(params: Any, holds: list[Hold | None]) -> tuple[Any, list[tuple[Hold, Any]]]:
    """``params`` with each leaf ``holds`` names marked (:func:`hold`), a layer stack's made
    a layer at a time inside its loop
    (:func:`~shardplug.core.operations.layer_gather.made_by_layer`);
    and each hold with its marked array (for :func:`outside_stacks`)."""
    leaves, tree = jax.tree.flatten(params)
    out, marked = [], []
    for leaf, site in zip(leaves, holds, strict=True):
        if site is None:
            out.append(leaf)
            continue
        whole = hold(site)(leaf)
        follow(leaf, whole)  # a stack gathered a layer at a time gathers it alike
        made_by_layer(whole, leaf, hold(site))
        out.append(whole)
        marked.append((site, whole))
    return jax.tree.unflatten(tree, out), marked


def said_outside_stacks(marked: list[tuple[Hold, Any]]) -> None:
    """Where a parallelism supplies the layer stack (a pipeline's schedules), only the
    stack's weights are rewritten (a layer at a time in its loop): say which held weights
    no stack took, whose products then run as they were."""
    outside = [site for site, whole in marked if not made_in_a_loop(whole)]
    if outside:
        kind = outside[0].kind
        warn_once(
            f"{kind}: a parallelism runs the layer stack itself (a pipeline's schedules), so "
            f"the held weights outside it ({', '.join(s.path for s in outside)}) multiply as "
            f"they were, not in {kind}"
        )


__all__ = ["HOLD", "RULES", "Hold", "Held", "held", "hold", "said_outside_stacks"]
