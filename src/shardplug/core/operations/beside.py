"""A weight made of a frozen part and a low-rank one, multiplied beside it: ``x W + s (x L) R``.

An adapter that makes a weight as ``W + s L @ R`` (LoRA's, :mod:`shardplug.finetuning.lora`) lets
the
model multiply by the sum: the model's code is the user's, and it reads one weight. But the
backward pass of ``x (W + s L R)`` computes the sum's gradient, ``x^T dy``, as large as the
weight and as costly as the product itself, and only then projects it onto ``L`` and ``R``.
Written beside the weight, ``x W + s (x L) R``, the frozen ``W`` (held by ``stop_gradient``)
has no gradient to compute: ``L``'s and ``R``'s come from ``x L`` and ``dy R^T``, products
of rank ``r``.

So the step rewrites what the model does, not its code. The adapter makes each weight
through a *mark* (:func:`mark`, a ``jax.jit`` named for it), and the step's rewrite
(:mod:`shardplug.core.operations.rewrite`) keeps a mark's output as its parts (:class:`Made`); a
cast,
transpose or layout of it applies to the frozen part (the low-rank one follows by its
dimensions' letters); a ``dot_general`` with it is ``x W`` plus one ``einsum`` of ``x``,
``L`` and ``R`` contracting ``x`` with the factor that shares its dimensions first; another
product registers its rule (:data:`PRODUCTS`). Calls are followed inside;
``jax.checkpoint`` blocks and ``shard_map`` programs are rebuilt on the parts. Any other
reader of the weight (a reshape, the model's own scan) gets it merged, said once.

A layer stack (:mod:`shardplug.core.operations.layer_stack`) makes each layer's weight in its loop
and
the rewrite runs on the loop's body, so a parallelism that supplies the stack (a pipeline's
schedules) never sees its call traced twice; the whole forward pass is rewritten
(:func:`forward`) only where none does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core.context import batch_axis_name
from shardplug.core.mesh import is_explicit
from shardplug.core.operations.rewrite import (
    MAKERS,
    Kept,
    bind,
    evaluate,
    forward,
    merged_products,
    rewritten,
    use,
)
from shardplug.errors import ConfigError, warn_once

#: the name of a mark's ``jax.jit``, followed by its number among :data:`_MARKS`
MARK = "shardplug_made_weight_"
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
class Made(Kept):
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
        key = jax.random.fold_in(self.key, use())  # a weight used twice: two masks
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

    def laid(self, fn: Callable[[Any], Any]) -> Made:
        return self.again([fn(self.base), self.left, self.right])

    def transposed(self, permutation: tuple[int, ...], fn: Callable[[Any], Any]) -> Made:
        dims = "".join(self.dims[p] for p in permutation)
        return dataclasses.replace(self, base=fn(self.base), dims=dims)

    def specs(self, spec: Any) -> list[Any] | None:
        """``W``'s spec, ``L`` split as ``W``'s input and ``R`` as its stacked and output
        dimensions (a weight not as stored: None)."""
        if not self.plain():
            return None
        names = tuple(spec) + (None,) * (self.base.ndim - len(spec))
        lead, cut = self.site.lead, len(self.left_dims) - 1
        keyed = [P()] if self.key is not None else []  # its dropout refuses the program
        return [spec, P(*names[:cut], None), P(*names[:lead], None, *names[cut:]), *keyed]

    def rules(self) -> dict[str, Callable[[Any, list[Any], int], Any | None]]:
        return PRODUCTS


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


PRODUCTS["dot_general"] = _product
MAKERS[MARK] = lambda number, ins: Made.of(_MARKS[number], *ins)

__all__ = ["MARK", "PRODUCTS", "Made", "Site", "bind", "evaluate", "forward", "low_rank_delta",
           "mark", "merged", "merged_products", "rewritten"]
