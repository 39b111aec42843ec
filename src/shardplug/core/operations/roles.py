"""What each parameter does in the step, read from its traced loss: the defaults of LoRA's and
float8's targets, chosen by structure, not by name.

A weight's role is decided by how the traced forward pass uses it:

- ``head``: a matrix product whose output reaches the loss through no other product (the
  logits the loss reads; a regression's output layer alike);
- ``embedding``: read by a gather of many rows (a lookup by token);
- ``router``: a product whose output decides a top-k, an argmax or a sort that the loss
  depends on (a mixture's router);
- ``grouped``: a product in which the weight has a batch dimension of its own (each of a
  mixture's experts), or a grouped product (several weights, each for its rows);
- ``convolution``: a convolution's kernel;
- ``linear``: any other matrix product by it (attention's projections, the MLP's);
- ``elementwise``: read by no product (a norm's scale, a bias).

A weight with several uses takes the first of the list above (a head tied to the embedding
is a ``head``). Views (casts, reshapes, transposes, a layer stack's slices) are followed to
the product that reads them; ``jit``, ``remat``, custom derivatives, scans, loops, conds and
``shard_map`` are entered, each call site apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.extend.core import Literal

#: the roles, in the order a weight with several uses takes them
ROLES = ("head", "embedding", "router", "grouped", "convolution", "linear", "elementwise")
#: the roles of a layer whose product LoRA adapts, and float8 runs, by default
ADAPTED = {"lora": ("linear", "grouped"), "float8": ("linear",)}

WHY = {
    "head": "its product's output reaches the loss through no other product (the head)",
    "embedding": "read by a lookup (a gather of rows): an embedding",
    "router": "its product's output chooses by top-k, argmax or sort (a router)",
    "grouped": "a grouped product's weight, one per group (a mixture's experts)",
    "convolution": "a convolution's kernel",
    "linear": "a matrix product's weight (a linear layer)",
    "elementwise": "read by no product (a norm's scale, a bias)",
}

_VIEWS = {
    "convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy",
    "copy_p", "sharding_constraint", "mesh_cast", "reshard", "slice", "dynamic_slice",
    "broadcast_in_dim", "optimization_barrier", "reduce_precision", "device_put",
    "stop_gradient", "pvary", "pcast",
}  # fmt: skip
_CHOOSERS = {"top_k", "argmax", "argmin", "sort", "approx_top_k"}


class Role(NamedTuple):
    """A parameter's role (one of :data:`ROLES`) and why, in a phrase."""

    kind: str
    why: str


class _Graph:
    """The forward pass as one graph of values: every call's body entered, each site apart."""

    def __init__(self) -> None:
        self.edges: dict[Any, list[tuple[Any, str]]] = defaultdict(list)  # value -> (next, how)
        self.products: list[tuple[Any, Any, list[Any], Any]] = []  # (eqn, site, ins, out)
        self.choosers: list[tuple[list[Any], list[Any]]] = []  # (ins, outs)
        self.gathers: list[tuple[Any, Any, Any]] = []  # (operand, indices' size, out)

    def link(self, a: Any, b: Any, how: str) -> None:
        self.edges[a].append((b, how))

    def add(self, jaxpr: Any, site: tuple, ins: list[Any] | None = None) -> list[Any]:
        """Add ``jaxpr``'s values at ``site``; ``ins``: the outer values its inputs take.
        Returns its outputs' values."""
        node = lambda v: (site, v)  # noqa: E731
        for outer, inner in zip(ins or [], jaxpr.invars, strict=False):
            if outer is not None:
                self.link(outer, node(inner), "view")
        for n, eqn in enumerate(jaxpr.eqns):
            here = (*site, n)
            ins_ = [None if isinstance(v, Literal) else node(v) for v in eqn.invars]
            outs = [node(v) for v in eqn.outvars]
            name = eqn.primitive.name
            if self._enter(eqn, here, ins_, outs):
                continue
            if _product(name):
                self.products.append((eqn, here, ins_, outs[0]))
                continue  # a product starts anew: nothing flows through it as a view
            if name in _CHOOSERS:  # a sort by its keys alone (the others ride along)
                keys = eqn.params.get("num_keys", 1) if name == "sort" else 1
                self.choosers.append((ins_[:keys], outs))
            if name == "gather":
                size = eqn.invars[1].aval.size
                self.gathers.append((ins_[0], size, outs[0]))
                if ins_[0] is not None:
                    self.link(ins_[0], outs[0], "view" if size <= 1 else "flow")
                if ins_[1] is not None:
                    self.link(ins_[1], outs[0], "flow")
                continue
            how = "view" if name in _VIEWS else "flow"
            for i, a in enumerate(ins_):
                if a is None:
                    continue
                for b in outs:  # a dynamic slice's offsets are no view of what it slices
                    self.link(a, b, how if i == 0 or how == "flow" else "flow")
        return [node(v) if not isinstance(v, Literal) else None for v in jaxpr.outvars]

    def _enter(self, eqn: Any, site: tuple, ins: list[Any], outs: list[Any]) -> bool:
        """Enter a call's body (jit, remat, custom derivatives, scan, while, cond,
        shard_map); False for any other primitive."""
        p, name = eqn.params, eqn.primitive.name
        if name == "scan":
            body = _open(p["jaxpr"])
            inner = self.add(body, site, ins)
            first, carry = _scan_counts(p)
            for a, b in zip(inner[:carry], body.invars[first:first + carry], strict=True):
                if a is not None:
                    self.link(a, (site, b), "flow")  # a loop's carry goes round
            self._outs(inner, outs)
            return True
        if name == "while":
            cond, body = _open(p["cond_jaxpr"]), _open(p["body_jaxpr"])
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            carry_in = ins[nc + nb:]
            self.add(cond, (*site, "cond"), ins[:nc] + carry_in)
            inner = self.add(body, site, ins[nc:nc + nb] + carry_in)
            for a, b in zip(inner, body.invars[nb:], strict=True):
                if a is not None:
                    self.link(a, (site, b), "flow")
            self._outs(inner, outs)
            return True
        if name == "cond":
            for k, branch in enumerate(p["branches"]):
                self._outs(self.add(_open(branch), (*site, k), ins[1:]), outs)
            return True
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            body = p.get(key)
            if body is None or not hasattr(_open(body), "eqns"):
                continue
            body = _open(body)
            if len(body.invars) != len(ins) or len(body.outvars) != len(outs):
                return False
            self._outs(self.add(body, site, ins), outs)
            return True
        return False

    def _outs(self, inner: list[Any], outs: list[Any]) -> None:
        for a, b in zip(inner, outs, strict=True):
            if a is not None:
                self.link(a, b, "view")

    def reach_within(self, start: Any, outside: set[Any]) -> set[Any]:
        """The values computed from ``start`` alone: reached over every edge, none of
        ``outside`` (what the batch reaches) among them."""
        seen, todo = {start}, [start]
        while todo:
            for b, _ in self.edges.get(todo.pop(), ()):
                if b not in seen and b not in outside:
                    seen.add(b)
                    todo.append(b)
        return seen

    def reach(self, starts: list[Any], hows: tuple[str, ...] = ("view", "flow")) -> set[Any]:
        """The values reached from ``starts`` along edges of kinds ``hows``."""
        seen, todo = set(starts), list(starts)
        while todo:
            for b, how in self.edges.get(todo.pop(), ()):
                if how in hows and b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen


def _product(name: str) -> bool:
    """Whether a primitive multiplies (a matrix product, a grouped one, a convolution)."""
    return "dot" in name or name.startswith("conv_general")


def _scan_counts(params: Any) -> tuple[int, int]:
    """A scan's numbers of constants and carries (JAX after 0.10 packs them in ``ft_in``)."""
    if "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _open(jaxpr: Any) -> Any:
    return getattr(jaxpr, "jaxpr", jaxpr)


def roles_in(closed: Any, paths: list[str]) -> dict[str, Role]:
    """Each parameter's :class:`Role` in ``closed``, a traced loss whose first inputs are the
    parameters' leaves (``paths``, in order) and whose first output is the loss
    (:func:`shardplug.core.step.trace_loss`).

    A product's weights are the parameters its operand is computed from alone, no input of
    the batch reaching it (cast, sliced, scaled, concatenated, normalised, gathered across
    devices). A product by no weight (attention's scores, a loss written as an einsum) is
    passed through; the head is a weight's product whose output reaches the loss and no
    other weight's product."""
    jaxpr = _open(closed)
    graph = _Graph()
    outs = graph.add(jaxpr, ())
    loss = outs[0]
    params = [((), v) for v in jaxpr.invars[: len(paths)]]
    inputs = [((), v) for v in jaxpr.invars[len(paths):]]
    floats = [x for x in inputs if jnp.issubdtype(x[1].aval.dtype, jnp.inexact)]
    every = ("view", "flow", "product")
    for _, _, ins, out in graph.products:
        for a in ins:
            if a is not None:
                graph.link(a, out, "product")
    batch = graph.reach(inputs, every)  # what an input of the batch (or state, or key) reaches
    computed = graph.reach(params + floats, every)  # what is more than integers and constants
    pure = {i: {n for n in graph.reach_within(p, batch)} for i, p in enumerate(params)}
    weighted: list[tuple[Any, list[Any], Any, dict[int, int]]] = []  # (eqn, ins, out, weights)
    for eqn, _, ins, out in graph.products:
        weights = {i: k for k, a in enumerate(ins) if a is not None
                   for i, seen in pure.items() if a in seen}  # fmt: skip
        if weights and any(a is not None and a in batch for a in ins):
            weighted.append((eqn, ins, out, weights))
        else:  # by no weight, or by weights alone (an adapter's L @ R): passed through
            for a in ins:
                if a is not None:
                    graph.link(a, out, "through")
    # what reaches the loss, backwards over every edge
    back: dict[Any, list[Any]] = defaultdict(list)
    for a, nexts in graph.edges.items():
        for b, _ in nexts:
            back[b].append(a)
    live, todo = {loss}, [loss]
    while todo:
        for a in back.get(todo.pop(), ()):
            if a not in live:
                live.add(a)
                todo.append(a)
    chosen = {i for ins, outs_ in graph.choosers if any(o in live for o in outs_) for i in ins
              if i is not None}  # fmt: skip
    read_by: dict[Any, int] = {}  # an activation a weight's product reads -> the product
    for n, (_, ins, _, weights) in enumerate(weighted):
        for k, a in enumerate(ins):
            if a is not None and k not in weights.values():
                read_by[a] = n
    uses: dict[int, set[str]] = defaultdict(set)
    for n, (eqn, ins, out, weights) in enumerate(weighted):
        reached = graph.reach([out], ("view", "flow", "through"))
        others = {read_by[v] for v in reached if v in read_by} - {n}
        activations = [a for k, a in enumerate(ins) if a is not None and k not in weights.values()]
        name = eqn.primitive.name
        for i, k in weights.items():
            if loss in reached and not others:  # (a top-k over its losses chooses no expert)
                uses[i].add("head")
            elif reached & chosen:
                uses[i].add("router")
            elif activations and not any(a in computed for a in activations):
                uses[i].add("embedding")  # by a one-hot of the tokens: a lookup
            elif name.startswith("conv_general"):
                uses[i].add("convolution")
            elif name != "dot_general" or _batched(eqn, k):
                uses[i].add("grouped")
            else:
                uses[i].add("linear")
    for operand, size, _ in graph.gathers:
        for i, seen in pure.items():
            if size > 1 and operand in seen:
                uses[i].add("embedding")
    roles = {}
    for i, path in enumerate(paths):
        kind = next((r for r in ROLES if r in uses[i]), "elementwise")
        roles[path] = Role(kind, WHY[kind])
    return roles


class Roles(Mapping):
    """`roles_in`' answer, read when first asked (``read()``): a step whose
    add-ons ask nothing pays nothing."""

    def __init__(self, read: Callable[[], dict[str, Role]]):
        self._read, self._roles = read, None

    def _all(self) -> dict[str, Role]:
        if self._roles is None:
            try:
                self._roles = self._read()
            except Exception as exc:  # a program this reading does not know: by name, said
                from shardplug.errors import one_line, warn_once

                warn_once(f"the weights' roles could not be read from the traced loss "
                          f"({type(exc).__name__}: {one_line(exc)}): default targets are "
                          "chosen by name")  # fmt: skip
                self._roles = {}
        return self._roles

    def __getitem__(self, path: str) -> Role:
        return self._all()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _batched(eqn: Any, at: int) -> bool:
    """Whether the weight, input ``at`` of a ``dot_general``, has a batch dimension in it (a
    mixture's experts, each multiplying its own rows)."""
    (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    return bool((lhs_batch, rhs_batch)[min(at, 1)])


__all__ = ["ADAPTED", "ROLES", "Role", "Roles", "roles_in"]
