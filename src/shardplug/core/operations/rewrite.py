"""The step's forward pass rewritten around weights kept as their parts: what runs the
products by an adapter's made weights beside them (:mod:`shardplug.core.operations.beside`, LoRA's)
and by a weight an add-on holds (:mod:`shardplug.core.operations.held`, float8's) its own way.

A weight is made (or held) through a *mark*: a ``jax.jit`` whose name a module registers
(:data:`MAKERS`). :func:`rewritten` traces a function to its jaxpr and runs it again equation
by equation: a mark's output stays a :class:`Kept` value (its parts); a cast, transpose,
layout or per-device mark of it applies to its parts as the kind says; a product with it
takes the kind's rule (:meth:`Kept.rules`); calls are followed inside, and
``jax.checkpoint`` blocks and ``shard_map`` programs rebuilt on the parts. Any other reader
gets the weight whole (:meth:`Kept.whole`, which says so once).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from shardplug.core import ops
from shardplug.core.mesh import is_explicit
from shardplug.core.operations.layer_gather import follow
from shardplug.errors import warn_once

#: calls whose body is followed inside
CALLS = frozenset({"jit", "pjit", "closed_call"})
#: rematerialised blocks, rebuilt with a kept weight's parts as their inputs
REMATS = frozenset({"remat2", "checkpoint", "remat"})
#: a kept weight through these is still the weight, laid out
LAYOUTS = frozenset({"sharding_constraint", "copy", "copy_p", "reshard", "mesh_cast"})
#: a per-device program's marks of a value varying over its axes: each part gets them
VARYING = frozenset({"pvary", "pcast"})
#: a mark's name prefix -> ``make(number, ins)``: the :class:`Kept` value that mark makes
MAKERS: dict[str, Callable[[int, list[Any]], Any]] = {}


class Kept:
    """A weight kept as its parts through a rewrite: each kind says how its parts are laid
    out, transposed and split, which products it runs (:meth:`rules`) and what it is whole."""

    def parts(self) -> list[Any]:
        raise NotImplementedError

    def again(self, parts: list[Any]) -> Kept:
        raise NotImplementedError

    def taken(self, it: Iterator[Any]) -> Kept:
        """Made again of the next parts of ``it`` (as many as :meth:`parts` gives)."""
        return self.again([next(it) for _ in self.parts()])

    def whole(self, where: str) -> Any:
        """The weight as the model would read it, ``where`` a reader the kind has no rule
        for (said once)."""
        raise NotImplementedError

    def laid(self, fn: Callable[[Any], Any]) -> Kept:
        """Its weight through ``fn`` (a cast or a layout)."""
        raise NotImplementedError

    def transposed(self, permutation: tuple[int, ...], fn: Callable[[Any], Any]) -> Kept:
        raise NotImplementedError

    def specs(self, spec: Any) -> list[Any] | None:
        """Its parts' specs in a per-device program whose weight's is ``spec`` (None: it
        cannot enter one, and is whole there)."""
        raise NotImplementedError

    def rules(self) -> dict[str, Callable[[Any, list[Any], int], Any | None]]:
        """A product's primitive name -> ``rule(eqn, ins, at)``, the product with this
        weight at input ``at`` (None: it cannot, and the weight is whole)."""
        raise NotImplementedError


_MERGED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardplug_merged", default=False)
#: the products by made weights so far in this rewrite (each dropout's mask its own)
_USES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("shardplug_uses",
                                                                        default=None)


def use() -> int:
    """This product's number in the rewrite under way (0 outside one)."""
    uses = _USES.get()
    if uses is None:
        return 0
    uses[0] += 1
    return uses[0]


@contextlib.contextmanager
def merged_products() -> Iterator[None]:
    """Inside, steps traced are not rewritten: they multiply by made weights merged
    (``x (W + s L R)``) and by held ones as they are; the reference a rewritten step is
    compared with."""
    token = _MERGED.set(True)
    try:
        yield
    finally:
        _MERGED.reset(token)


def rewritten(fn: Callable[..., Any], follow: Callable[[Any, Any], None] | None = None
              ) -> Callable[..., Any]:  # fmt: skip
    """``fn`` with every product by a kept weight run by its rule (see the module). ``follow``
    is told each argument's array and the traced one standing for it (for registries kept
    by an array's identity)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if _MERGED.get():
            return fn(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]
        out_tree: list[Any] = []

        def traced(*inner: Any) -> list[Any]:
            given = list(leaves)
            for i, x in zip(arrays, inner, strict=True):
                if follow is not None:
                    follow(leaves[i], x)
                given[i] = x
            out_tree.clear()
            given_args, given_kwargs = jax.tree.unflatten(tree, given)
            out = fn(*given_args, **given_kwargs)
            flat, treedef = jax.tree.flatten(out)
            out_tree.append(treedef)
            return flat

        closed = jax.make_jaxpr(traced)(*[leaves[i] for i in arrays])
        if not _marked(closed.jaxpr):
            outs = jcore.jaxpr_as_fun(closed)(*[leaves[i] for i in arrays])
        else:
            token = _USES.set([0])
            try:
                outs = evaluate(closed.jaxpr, closed.consts, [leaves[i] for i in arrays])
            finally:
                _USES.reset(token)
            outs = [o.whole("output") if isinstance(o, Kept) else o for o in outs]
        return jax.tree.unflatten(out_tree[0], outs)

    return run


def forward(adapter: Any, fn: Callable[..., Any], *args: Any, held: bool = False) -> Any:
    """``fn(*args)``, a training step's forward pass: rewritten (:func:`rewritten`) where
    ``adapter`` makes weights by marks (its ``beside``) or weights are ``held``, and no
    operation supplies the layer stack (whose blocks are rewritten on their own)."""
    supplied = ops.supplied("layer_stack") is not None
    if (getattr(adapter, "beside", False) or held) and not supplied:
        return rewritten(fn, follow)(*args)
    if supplied and (outside := getattr(adapter, "outside_stack", ())):
        warn_once(
            f"lora: a parallelism runs the layer stack itself (a pipeline's schedules), so the "
            f"adapters outside it ({', '.join(outside)}) are merged into their weights: "
            f"their frozen weights' gradients are computed, and their dropout is not applied"
        )
    return fn(*args)


def _maker(eqn: Any) -> Callable[[list[Any]], Kept] | None:
    """What a mark's call makes of its inputs (None: ``eqn`` is no mark)."""
    name = eqn.params.get("name", "") if eqn.primitive.name in CALLS else ""
    if not isinstance(name, str):
        return None
    for prefix, make in MAKERS.items():
        if name.startswith(prefix):
            number = int(name[len(prefix):])
            return lambda ins: make(number, ins)
    return None


def _body(eqn: Any) -> Any:
    """A call's or a rematerialised block's jaxpr (``jit``'s ``jaxpr``, ``closed_call``'s
    ``call_jaxpr``)."""
    return eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]


def _marked(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` makes a weight by a mark, in it or in a call it makes."""
    for eqn in jaxpr.eqns:
        if _maker(eqn) is not None:
            return True
        if eqn.primitive.name in CALLS | REMATS:
            inner = _body(eqn)
            if _marked(getattr(inner, "jaxpr", inner)):
                return True
    return False


def evaluate(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    """Run ``jaxpr`` on ``args`` (arrays or :class:`Kept`), kept weights kept as parts."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _equation(eqn, ins)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, ins: list[Any], **changed: Any) -> list[Any]:
    """``eqn``'s primitive bound again on ``ins`` (its parameters, ``changed`` changed),
    under its source line and name scope, as ``eval_jaxpr`` binds it."""
    params = eqn.primitive.get_bind_params({**eqn.params, **changed})
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    ctx = getattr(eqn.ctx, "manager", None) or contextlib.nullcontext()
    with _source(eqn), ctx:
        out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _source(eqn: Any) -> Any:
    """The equation's source line and name scope, for what is bound in its place (a
    profile's names, a warning's line); nothing where this JAX keeps them otherwise."""
    try:
        from jax._src import source_info_util as info

        names = info.current_name_stack() + eqn.source_info.name_stack
        return info.user_context(eqn.source_info.traceback, name_stack=names)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def _equation(eqn: Any, ins: list[Any]) -> list[Any]:
    name = eqn.primitive.name
    make = _maker(eqn)
    kept = [isinstance(x, Kept) for x in ins]
    if make is not None and not any(kept):
        return [make(ins)]
    if name in CALLS and (any(kept) or _marked(_body(eqn).jaxpr)):
        inner = _body(eqn)
        return evaluate(inner.jaxpr, inner.consts, ins)
    if not any(kept):
        return bind(eqn, ins)
    if kept.count(True) == 1:
        at = kept.index(True)
        rule = ins[at].rules().get(name)
        if rule is not None:
            with _source(eqn):
                out = rule(eqn, ins, at)
            if out is not None:
                return [out]
    if name in REMATS:
        return _remat(eqn, ins)
    if name == "shard_map" and all(x.specs(P()) is not None for x in ins if isinstance(x, Kept)):
        return _per_device(eqn, ins)
    if len(ins) == 1 and name in VARYING:  # each part varies over the axes the weight does
        return [ins[0].again([bind(eqn, [p])[0] for p in ins[0].parts()])]
    if len(ins) == 1 and name in LAYOUTS | {"convert_element_type"}:
        return [ins[0].laid(lambda w: bind(eqn, [w])[0])]
    if name == "transpose":
        return [ins[0].transposed(eqn.params["permutation"], lambda w: bind(eqn, [w])[0])]
    return bind(eqn, [x.whole(f"{name}") if isinstance(x, Kept) else x for x in ins])


def _flat(ins: list[Any]) -> list[Any]:
    return [p for x in ins for p in (x.parts() if isinstance(x, Kept) else [x])]


def _rebuilt(ins: list[Any], inner: Any, consts: list[Any], where: str,
             made_out: list[Kept | None] | None = None) -> Callable[..., Any]:  # fmt: skip
    """A function of :func:`_flat`'s ``ins`` running ``inner`` on them, made weights kept
    as parts. A weight made at its output is merged (``where`` said), or, given
    ``made_out``, returned as its parts, each output's :class:`Kept` (or None) noted there
    (:func:`_regrouped` makes them again)."""

    def run(*flat_in: Any) -> tuple[Any, ...]:
        it = iter(flat_in)
        given = [x.taken(it) if isinstance(x, Kept) else next(it) for x in ins]
        outs = evaluate(inner, consts, given)
        if made_out is None:
            return tuple(o.whole(where) if isinstance(o, Kept) else o for o in outs)
        made_out[:] = [o if isinstance(o, Kept) else None for o in outs]
        return tuple(_flat(outs))

    return run


def _regrouped(flat: list[Any], made_out: list[Kept | None]) -> list[Any]:
    it = iter(flat)
    return [next(it) if m is None else m.taken(it) for m in made_out]


def _per_device(eqn: Any, ins: list[Any]) -> list[Any]:
    """A per-device program (``shard_map``) reading kept weights, rebuilt with their parts
    as inputs, each split as its kind says (:meth:`Kept.specs`)."""
    specs = []
    for x, spec in zip(ins, eqn.params["in_specs"], strict=True):
        specs += x.specs(spec) if isinstance(x, Kept) else [spec]
    program = _rebuilt(ins, eqn.params["jaxpr"], [], "per-device program's output")
    flat = _flat(ins)
    if is_explicit(jax.sharding.get_abstract_mesh()):  # each factor laid out as its spec says
        flat = [jax.sharding.reshard(x, spec) for x, spec in zip(flat, specs, strict=True)]
    return list(jax.shard_map(
        program, mesh=eqn.params["mesh"], in_specs=tuple(specs),
        out_specs=tuple(eqn.params["out_specs"]), axis_names=set(eqn.params["newly_manual_axes"]),
        check_vma=eqn.params.get("check_vma", True),
    )(*flat))  # fmt: skip


def _remat(eqn: Any, ins: list[Any]) -> list[Any]:
    """A rematerialised block reading kept weights, rebuilt with their parts as inputs."""
    inner = eqn.params["jaxpr"]
    made_out: list[Kept | None] = []  # a block may return its weights (NNX's remat does)
    block = _rebuilt(ins, getattr(inner, "jaxpr", inner), list(getattr(inner, "consts", [])),
                     "rematerialised block's output", made_out)  # fmt: skip
    flat = jax.checkpoint(block, prevent_cse=eqn.params.get("prevent_cse", True),
                          policy=eqn.params.get("policy"))(*_flat(ins))  # fmt: skip
    return _regrouped(list(flat), made_out)



__all__ = ["CALLS", "LAYOUTS", "MAKERS", "REMATS", "VARYING", "Kept", "bind", "evaluate",
           "forward", "merged_products", "rewritten", "use"]  # fmt: skip
