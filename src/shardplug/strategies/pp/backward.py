"""A layer's backward pass cut in two: the input gradient (B) and the weight gradient (W).

Zero-bubble schedules run a layer's input gradient as soon as its output gradient arrives
(the stage before waits for it) and its weight gradient later, in what would be idle ticks
(Qi et al., 2023). Autodiff gives one pullback computing both, and asking it for the weight
gradient alone would compute the input-gradient chain a second time. So the pullback is
traced to a jaxpr, calls and rematerialised blocks inlined, and its operations are divided:
B runs every operation the input gradient needs, W the ones only the weight gradient needs,
and the values W reads from B's side (the output gradients of each weight product, mostly)
are B's extra outputs, the *stash*. Together they run each operation of the pullback once.

:func:`cut` returns the two halves of a function ``f(kept, given) -> (weight grads, input
grads)``: ``kept`` is what both halves have (a layer's residuals and weights), ``given`` what
only B has (the output gradient).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

#: call-like primitives whose body is inlined, so its operations are divided one by one
INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "remat"})


@dataclasses.dataclass(frozen=True)
class _Eqn:
    eqn: Any  # the jaxpr equation (primitive and parameters)
    ins: tuple[Any, ...]  # each an int (a value's number) or a _Const
    outs: tuple[int | None, ...]  # a value's number, None where dropped


@dataclasses.dataclass(frozen=True)
class _Const:
    value: Any


class _Flat:
    """A closed jaxpr's equations with every inlined call's body spliced in, values numbered."""

    def __init__(self, closed: Any):
        self.eqns: list[_Eqn] = []
        self.count = 0
        jaxpr = closed.jaxpr
        env = {v: _Const(c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True)}
        self.inputs = []
        for v in jaxpr.invars:
            env[v] = self._new()
            self.inputs.append(env[v])
        self.outputs = self._splice(jaxpr, env)

    def _new(self) -> int:
        self.count += 1
        return self.count - 1

    def _splice(self, jaxpr: Any, env: dict) -> list[Any]:
        def read(atom):
            return _Const(atom.val) if isinstance(atom, jcore.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            body = eqn.params.get("jaxpr") if eqn.primitive.name in INLINED else None
            if body is not None:
                inner = getattr(body, "jaxpr", body)
                consts = getattr(body, "consts", ())
                scope = {v: _Const(c) for v, c in zip(inner.constvars, consts, strict=True)}
                scope.update(zip(inner.invars, ins, strict=True))
                outs = self._splice(inner, scope)
                for v, o in zip(eqn.outvars, outs, strict=True):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = o
                continue
            outs = []
            for v in eqn.outvars:
                if isinstance(v, jcore.DropVar):
                    outs.append(None)
                else:
                    env[v] = self._new()
                    outs.append(env[v])
            self.eqns.append(_Eqn(eqn, tuple(ins), tuple(outs)))
        return [read(a) for a in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class Cut:
    """The two halves of a traced backward pass (see the module)."""

    flat: _Flat
    kept: int  # how many of the inputs are kept (the rest given)
    weights: int  # how many of the outputs are weight gradients (the rest input gradients)
    b: tuple[int, ...]  # the equations of B, in order
    w: tuple[int, ...]  # the equations of W, in order
    stash: tuple[int, ...]  # the values B hands W

    @property
    def shared(self) -> int:
        """Equations neither half needs (dead in the pullback)."""
        return len(self.flat.eqns) - len(self.b) - len(self.w)


def cut(fn: Callable[[Any, Any], tuple[Any, Any]], kept: Any, given: Any) -> tuple[Cut, Any]:
    """Trace ``fn(kept, given) -> (weight grads, input grads)`` and divide it (see the
    module); also returns the output trees ``(weight grads tree, input grads tree)``."""
    kept_leaves, kept_tree = jax.tree.flatten(kept)
    given_leaves, given_tree = jax.tree.flatten(given)
    trees = {}

    def flat_fn(k, g):
        gw, gx = fn(jax.tree.unflatten(kept_tree, k), jax.tree.unflatten(given_tree, g))
        gw_leaves, trees["w"] = jax.tree.flatten(gw)
        gx_leaves, trees["x"] = jax.tree.flatten(gx)
        trees["n"] = len(gw_leaves)
        return [*gw_leaves, *gx_leaves]

    closed = jax.make_jaxpr(flat_fn)(kept_leaves, given_leaves)
    flat = _Flat(closed)
    n_w = trees["n"]
    producer = {o: i for i, e in enumerate(flat.eqns) for o in e.outs if o is not None}

    def needed(outputs: list[Any]) -> set[int]:
        todo = [o for o in outputs if isinstance(o, int)]
        seen: set[int] = set()
        eqns: set[int] = set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            i = producer.get(v)
            if i is not None and i not in eqns:
                eqns.add(i)
                todo.extend(a for a in flat.eqns[i].ins if isinstance(a, int))
        return eqns

    b_eqns = needed(flat.outputs[n_w:])
    w_eqns = needed(flat.outputs[:n_w]) - b_eqns
    kept_values = set(flat.inputs[: len(kept_leaves)])
    w_made = {o for i in w_eqns for o in flat.eqns[i].outs if o is not None}
    read = [a for i in sorted(w_eqns) for a in flat.eqns[i].ins if isinstance(a, int)]
    read += [o for o in flat.outputs[:n_w] if isinstance(o, int)]
    stash = tuple(dict.fromkeys(v for v in read if v not in w_made and v not in kept_values))
    return (
        Cut(flat, len(kept_leaves), n_w, tuple(sorted(b_eqns)), tuple(sorted(w_eqns)), stash),
        (trees["w"], trees["x"]),
    )


def _run(flat: _Flat, eqns: tuple[int, ...], env: dict[int, Any]) -> None:
    for i in eqns:
        e = flat.eqns[i]
        args = [a.value if isinstance(a, _Const) else env[a] for a in e.ins]
        params = e.eqn.primitive.get_bind_params(e.eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)  # JAX < 0.7
        ctx = getattr(e.eqn.ctx, "manager", None) or contextlib.nullcontext()
        with ctx:
            out = e.eqn.primitive.bind(*subfuns, *args, **params)
        out = out if e.eqn.primitive.multiple_results else [out]
        for v, o in zip(e.outs, out, strict=True):
            if v is not None:
                env[v] = o


def _value(env: dict[int, Any], atom: Any) -> Any:
    return atom.value if isinstance(atom, _Const) else env[atom]


def input_grads(c: Cut, kept: list[Any], given: list[Any]) -> tuple[list[Any], list[Any]]:
    """B: the input gradients' leaves and the stash, from the kept and given leaves."""
    env = dict(zip(c.flat.inputs, [*kept, *given], strict=True))
    _run(c.flat, c.b, env)
    return [_value(env, o) for o in c.flat.outputs[c.weights :]], [env[v] for v in c.stash]


def weight_grads(c: Cut, kept: list[Any], stash: list[Any]) -> list[Any]:
    """W: the weight gradients' leaves, from the kept leaves and B's stash."""
    env = dict(zip(c.flat.inputs[: c.kept], kept, strict=True))
    env.update(zip(c.stash, stash, strict=True))
    _run(c.flat, c.w, env)
    return [_value(env, o) for o in c.flat.outputs[: c.weights]]
