"""A weight made of a frozen part and a low-rank one, multiplied beside it: ``x W + s (x L) R``.

An adapter that makes a weight as ``W + s L @ R`` (LoRA's, :mod:`shardplug.lora`) lets the
model multiply by the sum: the model's code is the user's, and it reads one weight. But the
backward pass of ``x (W + s L R)`` computes the sum's gradient, ``x^T dy``, as large as the
weight and as costly as the product itself, and only then projects it onto ``L`` and ``R``.
Written beside the weight, ``x W + s (x L) R``, the frozen ``W`` (held by ``stop_gradient``)
has no gradient to compute: ``L``'s and ``R``'s come from ``x L`` and ``dy R^T``, products
of rank ``r``.

So the step rewrites what the model does, not its code. The adapter makes each weight
through a *mark* (:func:`mark`, a ``jax.jit`` named for it), and :func:`rewritten` traces a
function to its jaxpr and runs it again equation by equation: a mark's output stays its
parts (:class:`Made`); a cast, transpose or layout of it applies to the frozen part (the
low-rank one follows by its dimensions' letters); a ``dot_general`` with it is ``x W`` plus
one ``einsum`` of ``x``, ``L`` and ``R`` contracting ``x`` with the factor that shares its
dimensions first; another product registers its rule (:data:`PRODUCTS`). Calls are followed
inside; ``jax.checkpoint`` blocks and ``shard_map`` programs are rebuilt on the parts. Any
other reader of the weight (a reshape, the model's own scan) gets it merged, said once.

A layer stack (:mod:`shardplug.core.layer_stack`) makes each layer's weight in its loop and
the rewrite runs on the loop's body, so a parallelism that supplies the stack (a pipeline's
schedules) never sees its call traced twice; the whole forward pass is rewritten
(:func:`forward`) only where none does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from shardplug.core import ops
from shardplug.core.context import batch_axis_name
from shardplug.core.layer_gather import follow
from shardplug.core.mesh import is_explicit
from shardplug.errors import ConfigError, warn_once

#: the name of a mark's ``jax.jit``, followed by its number among :data:`_MARKS`
MARK = "shardplug_made_weight_"
#: calls whose body is followed inside
CALLS = frozenset({"jit", "pjit", "closed_call"})
#: rematerialised blocks, rebuilt with a made weight's parts as their inputs
REMATS = frozenset({"remat2", "checkpoint", "remat"})
#: a made weight through these is still the weight, laid out (the low-rank part follows)
LAYOUTS = frozenset({"sharding_constraint", "copy", "copy_p", "reshard", "mesh_cast"})
#: a per-device program's marks of a value varying over its axes: each part gets them
VARYING = frozenset({"pvary", "pcast"})
#: a product's primitive name -> ``rule(eqn, ins, at)``: the product with its input ``at`` a
#: :class:`Made`, run beside it (None: it cannot, and the weight is merged). ``dot_general``
#: is core's; a parallelism's own product registers its rule in its module.
PRODUCTS: dict[str, Callable[[Any, list[Any], int], Any | None]] = {}
_RANK = "r"
_LETTERS = "abcdefghijklmnopqstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # r is the rank's


@dataclasses.dataclass(frozen=True)
class Site:
    """What a mark makes: ``W + scale L @ R`` for the weight at ``path``, ``lead`` stacked
    dimensions (each layer's, each expert's factors its own); ``dropout``: in training, the
    low-rank product's input is dropped with this probability (a key given to the mark)."""

    path: str
    scale: float
    lead: int
    dropout: float = 0.0


_MARKS: list[Site] = []
_MADE_BY: dict[Site, Callable[..., Any]] = {}


def mark(site: Site) -> Callable[[Any, Any, Any], Any]:
    """``(W, L, R) -> W + scale L @ R`` as one ``jax.jit`` call named for ``site``: what
    :func:`rewritten` finds in a jaxpr. Outside it, the merged weight, as it always was."""
    if site not in _MADE_BY:
        number = len(_MARKS)
        _MARKS.append(site)

        def made(w, left, right, *key):  # the key: the dropout's, read where multiplied
            return merged(w, left, right, site.scale, site.lead)

        made.__name__ = made.__qualname__ = f"{MARK}{number}"
        _MADE_BY[site] = jax.jit(made)
    return _MADE_BY[site]


def merged(w: Any, left: Any, right: Any, scale: float, lead: int) -> Any:
    """``w + scale left @ right``, the product laid out as ``w`` on explicit axes."""
    return w + _as(low_rank_delta(left, right, lead, w.shape) * scale, w)


def _lettered(ndim: int, cut: int, lead: int) -> tuple[str, str, str]:
    """A weight's letters, ``L``'s (its input's, the rank) and ``R``'s (lead, rank, output)."""
    dims = _LETTERS[:ndim]
    return dims, dims[:cut] + _RANK, dims[:lead] + _RANK + dims[cut:]


def low_rank_delta(left: Any, right: Any, lead: int, shape: tuple[int, ...],
                   einsum: Any = jnp.einsum) -> Any:  # fmt: skip
    """``L @ R`` over the rank, shaped as the weight: one contraction over named dimensions
    (no reshape, which would merge dimensions the strategy split apart); ``einsum``:
    ``numpy.einsum`` for host arrays (an export's merge)."""
    dims, left_dims, right_dims = _lettered(len(shape), left.ndim - 1, lead)
    return einsum(f"{left_dims},{right_dims}->{dims}", left, right)


def _as(delta: Any, like: Any) -> Any:
    """``delta`` in ``like``'s dtype, and its layout on explicit axes."""
    delta = delta.astype(like.dtype)
    if is_explicit(jax.sharding.get_abstract_mesh()):
        delta = jax.sharding.reshard(delta, jax.typeof(like).sharding.spec)
    return delta


@dataclasses.dataclass(frozen=True)
class Made:
    """A made weight, kept as its parts: ``base + scale einsum(left, right)``, ``base``'s
    dimensions lettered ``dims`` and the factors' ``left_dims`` and ``right_dims``."""

    base: Any
    left: Any
    right: Any
    dims: str
    left_dims: str
    right_dims: str
    site: Site
    key: Any = None  # the dropout's, in training

    @classmethod
    def of(cls, site: Site, w: Any, left: Any, right: Any, key: Any = None) -> Made:
        return cls(w, left, right, *_lettered(w.ndim, left.ndim - 1, site.lead), site, key)

    def dropped(self, x: Any) -> Any:
        """``x`` as the low-rank product reads it: dropped where the site asks (PEFT's
        ``lora_dropout``), each product its own mask, drawn over the global batch (its rows
        first): a per-device program (``batch_axis_name``) draws the whole and keeps its
        own rows, as :func:`shardplug.models.layers.dropout` does."""
        if self.key is None or not self.site.dropout:
            return x
        keep = 1.0 - self.site.dropout
        key = jax.random.fold_in(self.key, _use())  # a weight used twice: two masks
        axis = batch_axis_name()
        mesh = jax.sharding.get_abstract_mesh()
        if axis is not None:
            rows = x.shape[0]
            whole = jax.random.bernoulli(key, keep, (rows * jax.lax.axis_size(axis), *x.shape[1:]))
            kept = jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(axis) * rows, rows)
        elif getattr(mesh, "manual_axes", ()):
            raise ConfigError(
                f"lora dropout on {self.site.path}: its product runs in a per-device program "
                f"(a pipeline's stages, an expert-parallel exchange) whose rows are not the "
                f"batch's, so no mask over the batch can be drawn there: train without "
                f"--lora-dropout, or with a strategy that does not split this product"
            )
        elif is_explicit(mesh):  # each device draws its own share of the mask
            kept = jax.random.bernoulli(key, keep, x.shape, out_sharding=jax.typeof(x).sharding)
        else:
            kept = jax.random.bernoulli(key, keep, x.shape)
        return jnp.where(kept, x / keep, jnp.zeros((), x.dtype)).astype(x.dtype)

    def whole(self, where: str) -> Any:
        """The weight merged, said once: its frozen part's gradient is computed here."""
        dropped = (" and its dropout is not applied" if self.key is not None
                   and self.site.dropout else "")  # fmt: skip
        warn_once(
            f"lora: the model's {where} reads {self.site.path}'s weight, so its adapter is "
            f"merged into it there (W + s L R): the backward pass computes that weight's "
            f"gradient, as large as the weight{dropped} (adapters run beside a weight that "
            f"the model casts, transposes or multiplies)"
        )
        delta = jnp.einsum(f"{self.left_dims},{self.right_dims}->{self.dims}",
                           self.left, self.right)  # fmt: skip
        return self.base + _as(delta * self.site.scale, self.base)

    def plain(self) -> bool:
        """Whether the weight is as stored, one input and one output dimension after its
        stacked ones (each group's ``L`` is then ``(*lead, in, r)``, ``R`` ``(*lead, r,
        out)``: a grouped product takes them as it takes the weight)."""
        lead = self.site.lead
        return (self.dims == _LETTERS[: self.base.ndim] and self.base.ndim == lead + 2
                and len(self.left_dims) == lead + 2)  # fmt: skip

    def joined(self, product: Any, low_rank: Any) -> Any:
        """``product`` (by the frozen part) plus ``scale`` times ``low_rank`` (by the
        factors), laid out as ``product``."""
        return product + _as(low_rank * jnp.asarray(self.site.scale, low_rank.dtype), product)

    def parts(self) -> list[Any]:
        return [self.base, self.left, self.right, *([] if self.key is None else [self.key])]

    def again(self, parts: list[Any]) -> Made:
        return dataclasses.replace(self, base=parts[0], left=parts[1], right=parts[2],
                                   key=parts[3] if len(parts) > 3 else self.key)  # fmt: skip

    def taken(self, it: Iterator[Any]) -> Made:
        """Made again of the next parts of ``it`` (as many as :meth:`parts` gives)."""
        return self.again([next(it) for _ in self.parts()])


_MERGED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardplug_merged", default=False)
#: the products by made weights so far in this rewrite (each dropout's mask its own)
_USES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("shardplug_uses",
                                                                        default=None)


def _use() -> int:
    """This product's number in the rewrite under way (0 outside one)."""
    uses = _USES.get()
    if uses is None:
        return 0
    uses[0] += 1
    return uses[0]


@contextlib.contextmanager
def merged_products() -> Iterator[None]:
    """Inside, steps traced multiply by made weights merged (``x (W + s L R)``), as before
    the rewrite: the reference a rewritten step is compared with."""
    token = _MERGED.set(True)
    try:
        yield
    finally:
        _MERGED.reset(token)


def rewritten(fn: Callable[..., Any], follow: Callable[[Any, Any], None] | None = None
              ) -> Callable[..., Any]:  # fmt: skip
    """``fn`` with every product by a made weight run beside it (see the module). ``follow``
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
            outs = jcore.eval_jaxpr(closed.jaxpr, closed.consts, *[leaves[i] for i in arrays])
        else:
            token = _USES.set([0])
            try:
                outs = evaluate(closed.jaxpr, closed.consts, [leaves[i] for i in arrays])
            finally:
                _USES.reset(token)
            outs = [o.whole("output") if isinstance(o, Made) else o for o in outs]
        return jax.tree.unflatten(out_tree[0], outs)

    return run


def forward(adapter: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a training step's forward pass: rewritten (:func:`rewritten`) where
    ``adapter`` makes weights by marks (its ``beside``) and no operation supplies the layer
    stack (whose blocks are rewritten on their own)."""
    supplied = ops.supplied("layer_stack") is not None
    if getattr(adapter, "beside", False) and not supplied:
        return rewritten(fn, follow)(*args)
    if supplied and (outside := getattr(adapter, "outside_stack", ())):
        warn_once(
            f"lora: a parallelism runs the layer stack itself (a pipeline's schedules), so the "
            f"adapters outside it ({', '.join(outside)}) are merged into their weights: "
            f"their frozen weights' gradients are computed, and their dropout is not applied"
        )
    return fn(*args)


def _site(eqn: Any) -> Site | None:
    name = eqn.params.get("name", "") if eqn.primitive.name in CALLS else ""
    if isinstance(name, str) and name.startswith(MARK):
        return _MARKS[int(name[len(MARK):])]
    return None


def _body(eqn: Any) -> Any:
    """A call's or a rematerialised block's jaxpr (``jit``'s ``jaxpr``, ``closed_call``'s
    ``call_jaxpr``)."""
    return eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]


def _marked(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` makes a weight by a mark, in it or in a call it makes."""
    for eqn in jaxpr.eqns:
        if _site(eqn) is not None:
            return True
        if eqn.primitive.name in CALLS | REMATS:
            inner = _body(eqn)
            if _marked(getattr(inner, "jaxpr", inner)):
                return True
    return False


def evaluate(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    """Run ``jaxpr`` on ``args`` (arrays or :class:`Made`), made weights kept as parts."""
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
    site = _site(eqn)
    if site is not None and not any(isinstance(x, Made) for x in ins):
        return [Made.of(site, *ins)]
    made = [isinstance(x, Made) for x in ins]
    if name in CALLS and (any(made) or _marked(_body(eqn).jaxpr)):
        inner = _body(eqn)
        return evaluate(inner.jaxpr, inner.consts, ins)
    if not any(made):
        return bind(eqn, ins)
    rule = PRODUCTS.get(name)
    if rule is not None and made.count(True) == 1:
        with _source(eqn):
            out = rule(eqn, ins, made.index(True))
        if out is not None:
            return [out]
    if name in REMATS:
        return _remat(eqn, ins)
    if name == "shard_map" and all(x.plain() for x in ins if isinstance(x, Made)):
        return _per_device(eqn, ins)
    if len(ins) == 1 and name in VARYING:  # each part varies over the axes the weight does
        return [ins[0].again([bind(eqn, [p])[0] for p in ins[0].parts()])]
    if len(ins) == 1 and name in LAYOUTS | {"convert_element_type"}:
        w = ins[0]
        return [w.again([bind(eqn, [w.base])[0], w.left, w.right])]
    if name == "transpose":
        w = ins[0]
        dims = "".join(w.dims[p] for p in eqn.params["permutation"])
        return [dataclasses.replace(w, base=bind(eqn, [w.base])[0], dims=dims)]
    return bind(eqn, [x.whole(f"{name}") if isinstance(x, Made) else x for x in ins])


def _product(eqn: Any, ins: list[Any], at: int) -> Any | None:
    """``dot_general(x, W + s L R)`` as ``dot_general(x, W) + s einsum(x, L, R)``."""
    w: Made = ins[at]
    x = ins[1 - at]
    base = bind(eqn, [w.base if i == at else v for i, v in enumerate(ins)])[0]
    (contract, batch) = eqn.params["dimension_numbers"]
    x_c, w_c = (contract[1], contract[0]) if at == 0 else contract
    x_b, w_b = (batch[1], batch[0]) if at == 0 else batch
    used = set(w.dims) | {_RANK}
    fresh = (c for c in _LETTERS if c not in used)
    x_dims = [""] * x.ndim
    for a, b in itertools.chain(zip(x_c, w_c, strict=True), zip(x_b, w_b, strict=True)):
        x_dims[a] = w.dims[b]
    x_dims = [d or next(fresh) for d in x_dims]
    x_free = "".join(x_dims[d] for d in range(x.ndim) if d not in x_c and d not in x_b)
    w_free = "".join(w.dims[d] for d in range(w.base.ndim) if d not in w_c and d not in w_b)
    out = "".join(w.dims[b] for b in w_b) + (w_free + x_free if at == 0 else x_free + w_free)
    contracted = {w.dims[b] for b in w_c}
    first = 2 if not contracted <= set(w.left_dims) and contracted <= set(w.right_dims) else 1
    factors = [w.left.astype(w.base.dtype), w.right.astype(w.base.dtype)]
    dims = [w.left_dims, w.right_dims]
    given = dict(precision=eqn.params.get("precision"), preferred_element_type=base.dtype)
    x = w.dropped(x)
    if not is_explicit(jax.sharding.get_abstract_mesh()):
        delta = jnp.einsum(f"{''.join(x_dims)},{dims[0]},{dims[1]}->{out}", x, *factors,
                           optimize=[(0, first), (0, 1)], **given)  # fmt: skip
        return w.joined(base, delta)
    # explicit axes: each contraction told its output's layout (x's rows kept, then the
    # product's), as a sum over a split dimension must be
    then = dims[2 - first]
    kept = "".join(dict.fromkeys(c for c in "".join(x_dims) + dims[first - 1]
                                 if c in out or c in then))  # fmt: skip
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    low = jnp.einsum(f"{''.join(x_dims)},{dims[first - 1]}->{kept}", x, factors[first - 1],
                     out_sharding=P(*(spec[x_dims.index(c)] if c in x_dims else None
                                      for c in kept)), **given)  # fmt: skip
    delta = jnp.einsum(f"{kept},{then}->{out}", low.astype(w.base.dtype), factors[2 - first],
                       out_sharding=jax.typeof(base).sharding.spec, **given)  # fmt: skip
    return w.joined(base, delta)


def _flat(ins: list[Any]) -> list[Any]:
    return [p for x in ins for p in (x.parts() if isinstance(x, Made) else [x])]


def _rebuilt(ins: list[Any], inner: Any, consts: list[Any], where: str,
             made_out: list[Made | None] | None = None) -> Callable[..., Any]:  # fmt: skip
    """A function of :func:`_flat`'s ``ins`` running ``inner`` on them, made weights kept
    as parts. A weight made at its output is merged (``where`` said), or, given
    ``made_out``, returned as its parts, each output's :class:`Made` (or None) noted there
    (:func:`_regrouped` makes them again)."""

    def run(*flat_in: Any) -> tuple[Any, ...]:
        it = iter(flat_in)
        given = [x.taken(it) if isinstance(x, Made) else next(it) for x in ins]
        outs = evaluate(inner, consts, given)
        if made_out is None:
            return tuple(o.whole(where) if isinstance(o, Made) else o for o in outs)
        made_out[:] = [o if isinstance(o, Made) else None for o in outs]
        return tuple(_flat(outs))

    return run


def _regrouped(flat: list[Any], made_out: list[Made | None]) -> list[Any]:
    it = iter(flat)
    return [next(it) if m is None else m.taken(it) for m in made_out]


def _per_device(eqn: Any, ins: list[Any]) -> list[Any]:
    """A per-device program (``shard_map``) reading made weights, rebuilt with their parts
    as inputs, each factor split as its weight's dimensions are."""
    specs = []
    for x, spec in zip(ins, eqn.params["in_specs"], strict=True):
        if not isinstance(x, Made):
            specs.append(spec)
            continue
        names = tuple(spec) + (None,) * (x.base.ndim - len(spec))
        lead, cut = x.site.lead, len(x.left_dims) - 1
        specs += [spec, P(*names[:cut], None), P(*names[:lead], None, *names[cut:])]
        specs += [P()] if x.key is not None else []  # its dropout refuses the program
    program = _rebuilt(ins, eqn.params["jaxpr"], [], "per-device program's output")
    flat = _flat(ins)
    if is_explicit(jax.sharding.get_abstract_mesh()):  # each factor laid out as its spec says
        flat = [jax.sharding.reshard(x, spec) for x, spec in zip(flat, specs, strict=True)]
    return list(jax.shard_map(
        program, mesh=eqn.params["mesh"], in_specs=tuple(specs),
        out_specs=tuple(eqn.params["out_specs"]), axis_names=set(eqn.params["newly_manual_axes"]),
        check_vma=eqn.params.get("check_vma", True),
    )(*flat))  # fmt: skip


PRODUCTS["dot_general"] = _product


def _remat(eqn: Any, ins: list[Any]) -> list[Any]:
    """A rematerialised block reading made weights, rebuilt with their parts as inputs."""
    inner = eqn.params["jaxpr"]
    made_out: list[Made | None] = []  # a block may return its weights (NNX's remat does)
    block = _rebuilt(ins, getattr(inner, "jaxpr", inner), list(getattr(inner, "consts", [])),
                     "rematerialised block's output", made_out)  # fmt: skip
    flat = jax.checkpoint(block, prevent_cse=eqn.params.get("prevent_cse", True),
                          policy=eqn.params.get("policy"))(*_flat(ins))  # fmt: skip
    return _regrouped(list(flat), made_out)


__all__ = ["MARK", "PRODUCTS", "Made", "Site", "bind", "evaluate", "forward", "low_rank_delta",
           "mark", "merged", "merged_products", "rewritten"]
