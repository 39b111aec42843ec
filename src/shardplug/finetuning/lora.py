"""Low-rank adapters (LoRA) on a frozen model, in any framework, under every strategy.

:func:`with_lora` wraps a :class:`shardplug.Task` (or :class:`LoraAdapter` an
:class:`~shardplug.Adapter`): the parameters become ``{"base": the model's, "lora": the
factors}``; each target weight ``W`` gets two factors ``L`` and ``R`` of rank ``r``, and the
model runs on ``W + (alpha / r) L @ R``: a training step multiplies beside the frozen weight,
``x W + s (x L) R`` (:mod:`shardplug.core.operations.beside`), so the frozen weight's gradient is
never
computed; elsewhere (evaluation, export) the weight is merged. The base is frozen: it
reaches the model through ``jax.lax.stop_gradient``, so no gradient of it is computed, and the
task's optimizer runs through ``optax.masked`` on the factors alone, so no optimizer state
exists for it. ``R`` starts at zero: the first step's loss is the base model's, exactly.

A weight's dimensions after its stacked ones (logical names ``layers`` and ``expert``: each
layer's, each expert's weight gets adapters of its own) are cut into
its input and output: where the model annotates ``embed`` first, that one dimension is the
input; where ``embed`` comes last, it is the output; otherwise the first dimension is the
input. ``L`` is ``(*layers, *input, r)`` and ``R`` ``(*layers, r, *output)``, annotated with
the weight's own logical names, so every parallelism lays them out as their weight: ``L``
split as the weight's input, ``R`` as its output (tensor parallelism's column and row
splits, fsdp's, a pipeline's stage split of the layers).

A weight of a layer stack (``layers`` first) is made one layer at a time, inside the
stack's loop (:func:`shardplug.core.operations.layer_gather.made_by_layer`), and the loop's body is
rewritten there: each layer's products run beside its frozen weight (where a weight is
merged instead, one layer's at a time).

QLoRA: with ``quantize`` (``int8``, ``int4`` or ``nf4``) the frozen base's targets are
stored quantized by Qwix (:func:`qwix.quantize`; 8-bit with one scale per output, 4-bit with
one per block of 64 inputs, as QLoRA's) and dequantized in the forward pass, a layer at a
time in a stack: the base costs 1 or 1/2 byte a parameter where it is the adapters' target.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardplug.core.operations.beside import Site, mark
from shardplug.core.operations.layer_stack import LAYERS
from shardplug.core.operations.roles import ADAPTED
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ConfigError
from shardplug.finetuning.quantize import QTYPES, Quantized, is_quantized, layout, quantized
from shardplug.models.adapter import Adapter

#: a parameter on a path with a component like these is no target by default: embeddings,
#: positions, the output head, norms, a mixture's router
NOT_TARGETS = re.compile(
    r"(^|/)([^/]*embed[^/]*|[^/]*position[^/]*|head|lm_head|wte|wpe|out|output|logits"
    r"|[^/]*norm[^/]*|[^/]*router[^/]*)(/|$)"
)
#: leading dimensions that hold one weight each (a layer stack's layers, a mixture's experts):
#: each gets adapters of its own
STACKED = ("layers", "expert", "experts")


class LoraAdapter(Adapter):
    """``base`` with low-rank adapters on its ``targets`` (see the module).

    :param base: the model's adapter (``shardplug.from_nnx(...)`` and its kin, or a pretrained
        checkpoint's).
    :param rank: each adapter's rank ``r``.
    :param alpha: the adapters' scale is ``alpha / rank`` (default ``rank``: 1).
    :param targets: a regular expression searched in each parameter's path; default: the
        weights of the linear layers and of a mixture's experts, as ``roles`` says (not the
        head, embeddings, routers, convolutions, norms); without ``roles``, by name: every
        floating-point matrix but embeddings, positions, the output head, norms and a
        mixture's router.
    :param roles: what each of the base's parameters does in the step, by its path
        (:func:`shardplug.weight_roles`; :func:`with_lora` reads it from the task's first
        batch).
    :param seed: the seed of ``L``'s initial values (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``).
    :param initial: the factors to start from instead (adapters trained before, such as
        PEFT's: :mod:`shardplug.pretrained.peft`), by their weight's path: ``(L, R)``.
    :param quantize: QLoRA: store the targets' frozen weights quantized, ``int8``, ``int4``
        or ``nf4`` (see the module).
    :param dropout: PEFT's ``lora_dropout``: in training, each adapter's input is dropped
        with this probability (and the rest scaled by ``1 / (1 - dropout)``), ``x W + s
        (drop(x) L) R``; the frozen product sees the whole input.
    """

    def __init__(self, base: Adapter, rank: int, *, alpha: float | None = None,
                 targets: str | None = None, seed: int = 0,
                 initial: dict[str, tuple[Any, Any]] | None = None,
                 quantize: str | None = None, dropout: float = 0.0,
                 roles: Mapping[str, Any] | None = None):  # fmt: skip
        if not isinstance(base, Adapter):
            raise ConfigError(f"lora: base must be a shardplug adapter, got {type(base).__name__}")
        if isinstance(base, LoraAdapter):
            raise ConfigError("lora: this model already has adapters: give its base instead")
        if not (isinstance(rank, int) and rank > 0):
            raise ConfigError(f"lora: rank must be a positive integer, got {rank!r}")
        if quantize is not None and quantize not in QTYPES:
            raise ConfigError(f"lora: quantize must be one of {', '.join(QTYPES)}, got "
                              f"{quantize!r}")  # fmt: skip
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            raise ConfigError(f"lora: alpha must be a positive number, got {alpha}")
        try:
            self.pattern = None if targets is None else re.compile(targets)
        except re.error as e:
            raise ConfigError(
                f"lora: targets {targets!r} is not a regular expression ({e})"
            ) from None
        self.base, self.rank, self.seed, self.initial = base, rank, seed, initial or {}
        self.roles = roles
        self.quantize = quantize
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not (
            0.0 <= dropout < 1.0
        ):
            raise ConfigError(f"lora: dropout is a probability in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        self.alpha = float(alpha if alpha is not None else rank)
        self.framework = base.framework
        abstract_params, _ = base.abstract(jax.random.key(0))
        self.abstract_base = abstract_params
        self.paths = leaf_paths(abstract_params)
        self.cuts = self._cuts(abstract_params, base.annotations(abstract_params))
        self.base_size = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
        unknown = sorted(set(self.initial) - set(self.targets()))
        if unknown:
            raise ConfigError(f"lora: initial factors for {unknown[0]}, which has no adapter")
        self.size = sum(math.prod(x.shape) for x in jax.tree.leaves(
            jax.eval_shape(lambda: self._factors(abstract_params))))  # fmt: skip
        if base.variables is not None:
            params, state = base.variables
            self.variables = ({"base": self._stored(params), "lora": self._factors(params)},
                              state)  # fmt: skip
        if base.weights is not None:
            self.weights = self._read

    @property
    def outside_stack(self) -> list[str]:
        """The targets no layer stack makes a layer at a time (rewritten with the whole
        forward pass, not inside a stack's loop)."""
        return [p for p in self.targets() if p not in self.by_layer]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> str:
        """One line, as a run says it: ``rank 16, alpha 32 on 224 weights: 41.9M trainable
        parameters beside 8.03B frozen (0.52%)``."""
        from shardplug.core.units import count

        stored = f"; the targets stored in {self.quantize}" if self.quantize else ""
        if self.pattern is None and self.roles is not None:
            kinds = {r.kind for r in self.roles.values()}
            left = sorted(kinds - {"linear", "grouped", "elementwise"})
            stored += ("; chosen by their use in the traced step: linear layers"
                       + (" and experts" if "grouped" in kinds else "")
                       + (f", not the {', '.join(left)}" if left else ""))  # fmt: skip
        return (f"rank {self.rank}, alpha {self.alpha:g} on {len(self.targets())} weights: "
                f"{count(self.size)} trainable parameters beside {count(self.base_size)} frozen "
                f"({100 * self.size / self.base_size:.3g}%){stored}")  # fmt: skip

    #: a training step runs the model's products by a target beside its frozen weight
    #: (:mod:`shardplug.core.operations.beside`): its gradient is never computed
    beside = True

    def trainable(self, params: Any) -> Any:
        """The factors train; the base is frozen."""
        return {"base": jax.tree.map(lambda _: False, params["base"]),
                "lora": jax.tree.map(lambda _: True, params["lora"])}  # fmt: skip

    def targets(self) -> list[str]:
        """The paths of the parameters that have adapters."""
        return [path for path, cut in self.cuts.items() if cut is not None]

    def init(self, rng: jax.Array) -> tuple[Any, Any]:
        params, state = self.base.init(rng)
        return {"base": self._stored(params), "lora": self._factors(params)}, state

    def model_annotations(self, params: Any) -> Any:
        plain = jax.tree.map(_abstract, params["base"], is_leaf=is_quantized)
        base = self.base.annotations(plain)
        if base is None:
            base = jax.tree.map(lambda _: P(), plain)
        specs = dict(zip(self.paths, _specs(base), strict=True))
        if self.quantize is not None:  # qvalue as the weight, its scale where it has the dim
            stored = jax.tree.leaves(params["base"], is_leaf=is_quantized)
            base = jax.tree.unflatten(jax.tree.structure(plain), [
                layout(w, specs[path]) for path, w in zip(self.paths, stored, strict=True)
            ])  # fmt: skip
        factors = {}
        for path, cut in self.cuts.items():
            if cut is None:
                continue
            lead, cut_at, ndim = cut
            names = tuple(specs[path]) + (None,) * (ndim - len(specs[path]))
            factors[_key(path)] = {
                "l": P(*names[:cut_at], None),
                "r": P(*names[:lead], None, *names[cut_at:ndim]),
            }
        return {"base": base, "lora": factors}

    def bind(self, params: Any, state: Any, *, rng: jax.Array, train: bool) -> Any:
        key = jax.random.fold_in(rng, 0x10CA) if train and self.dropout else None
        return self.base.bind(self.merged(params, key), state, rng=rng, train=train)

    def state_of(self, model: Any, state: Any) -> Any:
        return self.base.state_of(model, state)

    def merged(self, params: Any, key: jax.Array | None = None) -> Any:
        """The base's parameters with each target's adapter merged in, ``W + scale L @ R``,
        the base held fixed (``stop_gradient``): the model's own parameters, for its forward
        pass or to export. ``key``: the dropout's, in training (each target's its own, each
        layer's of a stack its own)."""
        from shardplug.core.operations.layer_gather import follow, made_by_layer

        leaves, tree = jax.tree.flatten(params["base"], is_leaf=is_quantized)
        out = []
        for path, given in zip(self.paths, leaves, strict=True):
            w = jax.lax.stop_gradient(given)
            for old, new in zip(jax.tree.leaves(given), jax.tree.leaves(w), strict=True):
                follow(old, new)  # a stack gathered a layer at a time (fsdp) gathers this alike
            cut = self.cuts.get(path)
            if cut is None:
                out.append(w)
                continue
            f = params["lora"][_key(path)]
            parts = (w, f["l"], f["r"])
            if key is not None:  # a key for each layer a stack makes its weight in
                own = jax.random.fold_in(key, self.paths.index(path))
                parts += (jax.random.split(own, w.shape[0]) if path in self.by_layer else own,)
            whole = self._made(parts, cut[0], path)
            follow(given, whole)
            if path in self.by_layer:  # a layer stack makes one layer's at a time instead
                made_by_layer(whole, parts,
                              lambda layer, lead=cut[0] - 1, p=path: self._made(layer, lead, p))
            out.append(whole)
        return jax.tree.unflatten(tree, out)

    def _made(self, parts: tuple[Any, ...], lead: int, path: str) -> Any:
        """``W + scale L @ R`` of a weight's parts (``W`` dequantized where it is stored
        quantized); ``lead``: its stacked dimensions. Made through a mark
        (:func:`shardplug.core.operations.beside.mark`): a training step multiplies beside it."""
        w, *rest = parts
        if is_quantized(w):
            w = w.dequantized()
        return mark(Site(path, self.scale, lead, self.dropout))(w, *rest)

    def _stored(self, params: Any) -> Any:
        """The base's parameters as stored: each target quantized where asked (QLoRA)."""
        if self.quantize is None:
            return params
        leaves, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [
            w if self.cuts.get(path) is None else self._quantized(w, self.cuts[path])
            for path, w in zip(self.paths, leaves, strict=True)
        ])  # fmt: skip

    def _quantized(self, w: Any, cut: tuple[int, int, int]) -> Quantized:
        return quantized(w, self.quantize, cut[0], cut[1])

    def _cuts(self, params: Any, annotations: Any | None) -> dict[str, tuple[int, int, int] | None]:
        """Each parameter's path: ``(lead, cut, ndim)`` for a target (its layer dimensions,
        where its input ends, its dimensions), None for the rest."""
        specs = _specs(annotations) if annotations is not None else None
        cuts: dict[str, tuple[int, int, int] | None] = {}
        self.by_layer: set[str] = set()  # targets stacked by a layer stack (a scan's)
        for i, (path, leaf) in enumerate(zip(leaf_paths(params), jax.tree.leaves(params),
                                             strict=True)):  # fmt: skip
            names = tuple(specs[i]) if specs is not None else ()
            names = names + (None,) * (leaf.ndim - len(names))
            lead = 0
            while lead < leaf.ndim and names[lead] in STACKED:
                lead += 1
            if self.pattern is not None:
                chosen = self.pattern.search(path) is not None
            elif self.roles is not None and path in self.roles:
                chosen = self.roles[path].kind in ADAPTED["lora"]
            else:
                chosen = NOT_TARGETS.search(path) is None
            cut = lead + 1
            if lead < leaf.ndim and names[lead] != "embed" and names[leaf.ndim - 1] == "embed":
                cut = leaf.ndim - 1
            # a weight of more than two dimensions says by its names which are its input
            # (a convolution's kernel or an unnamed stack does not: no target by default)
            named = any(n is not None for n in names[lead:])
            fan_in, fan_out = math.prod(leaf.shape[lead:cut]), math.prod(leaf.shape[cut:])
            why = None
            if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.ndim - lead < 2:
                why = ("an adapter needs a floating-point weight with an input and an output "
                       "dimension")  # fmt: skip
            elif leaf.ndim - lead > 2 and not named:
                why = ("its dimensions are not named (the model's annotations or rules), so "
                       "which are its input is not known")  # fmt: skip
            elif self.rank >= min(fan_in, fan_out):
                why = (f"rank {self.rank} is not below its input ({fan_in}) and output "
                       f"({fan_out}): an adapter would be no smaller than the weight")  # fmt: skip
                if chosen and self.pattern is None and leaf.ndim - lead == 2:  # a matrix
                    raise ConfigError(
                        f"lora: {path}, of shape {tuple(leaf.shape)}, is one of the default "
                        f"targets: {why}; choose a rank below {min(fan_in, fan_out)}, or "
                        "targets that leave it out"
                    )
            if chosen and why is not None and self.pattern is not None:
                raise ConfigError(
                    f"lora: targets {self.pattern.pattern!r} match {path}, of shape "
                    f"{tuple(leaf.shape)} and {leaf.dtype}: {why}; narrow the pattern"
                )
            cuts[path] = (lead, cut, leaf.ndim) if chosen and why is None else None
            if cuts[path] is not None and names[0] == LAYERS:
                self.by_layer.add(path)
        if not any(c is not None for c in cuts.values()):
            said = (f"targets {self.pattern.pattern!r}" if self.pattern is not None
                    else "the default targets")  # fmt: skip
            raise ConfigError(
                f"lora: {said} match no weight of this model; its parameters are "
                f"{', '.join(list(cuts)[:6])}: give targets, a pattern searched in these paths"
            )
        return cuts

    def _factors(self, params: Any) -> dict[str, Any]:
        """The adapters' first values: ``L`` uniform in ``+-1/sqrt(fan_in)``, ``R`` zero."""
        key = jax.random.key(self.seed)
        factors = {}
        for i, (path, w) in enumerate(zip(leaf_paths(params), jax.tree.leaves(params),
                                          strict=True)):  # fmt: skip
            cut = self.cuts.get(path)
            if cut is None:
                continue
            lead, cut_at, ndim = cut
            fan_in = math.prod(w.shape[lead:cut_at])
            bound = 1.0 / math.sqrt(fan_in)
            l_shape = (*w.shape[:cut_at], self.rank)
            r_shape = (*w.shape[:lead], self.rank, *w.shape[cut_at:ndim])
            if path in self.initial:
                left, right = self.initial[path]
                if (tuple(left.shape), tuple(right.shape)) != (l_shape, r_shape):
                    raise ConfigError(
                        f"lora: {path}'s factors are {tuple(left.shape)} and "
                        f"{tuple(right.shape)}; its weight {tuple(w.shape)} at rank "
                        f"{self.rank} takes {l_shape} and {r_shape}"
                    )
                factors[_key(path)] = {"l": jnp.asarray(left, jnp.float32),
                                       "r": jnp.asarray(right, jnp.float32)}  # fmt: skip
                continue
            factors[_key(path)] = {
                "l": jax.random.uniform(
                    jax.random.fold_in(key, i), l_shape, jnp.float32, -bound, bound
                ),
                "r": jnp.zeros((*w.shape[:lead], self.rank, *w.shape[cut_at:ndim]), jnp.float32),
            }
        return factors

    def _read(self, shardings: Any) -> Any:
        """A pretrained base read into its shardings, the factors made in theirs."""
        stored = jax.tree.leaves(shardings["base"], is_leaf=is_quantized)
        plain = [s.values if is_quantized(s) else s for s in stored]  # the weight's own
        tree = jax.tree.structure(self.abstract_base)

        def each(i: int, leaf: Any) -> Any:  # QLoRA: a target quantized as soon as it is read
            if not is_quantized(stored[i]):
                return leaf
            quantize = functools.partial(self._quantized, cut=self.cuts[self.paths[i]])
            return jax.jit(quantize, out_shardings=stored[i])(leaf)  # the read one let go

        read = self.base.weights
        if "each" in inspect.signature(read).parameters:  # one weight on the devices at a time
            leaves = jax.tree.leaves(read(jax.tree.unflatten(tree, plain), each=each),
                                     is_leaf=is_quantized)  # fmt: skip
        else:
            leaves = jax.tree.leaves(read(jax.tree.unflatten(tree, plain)))
            leaves = [each(i, leaf) for i, leaf in enumerate(leaves)]
        factors = jax.jit(lambda: self._factors(self.abstract_base),
                          out_shardings=shardings["lora"])()  # fmt: skip
        return {"base": jax.tree.unflatten(tree, leaves), "lora": factors}


def _roles(task: Any) -> dict[str, Any] | None:
    """Each parameter's role in ``task``'s loss on its first batch (for the default
    targets), or None, said once, where the batch cannot be read without taking it from the
    run (its data is one iterator) or the loss does not trace alone (it names a mesh's axes,
    say)."""
    from shardplug.core.step import weight_roles
    from shardplug.errors import warn_once

    data, why = task.data, None
    try:
        if hasattr(data, "first"):  # shardplug's Batches: batch 0, with no read-ahead
            batch = data.first()
        else:
            data = data() if callable(data) else data
            if iter(data) is data and not callable(task.data):
                why = "its data is one iterator, whose first batch the run needs"
            else:
                batch = next(iter(data))
        if why is None:
            return weight_roles(task.adapter, task.loss_fn, batch)
    except StopIteration:
        why = "its data holds no batch"
    except Exception as exc:  # any failure to trace: chosen by name, and said
        why = f"its loss does not trace alone: {type(exc).__name__}"
    warn_once(f"lora: the default targets are chosen by name ({why}): give targets= (or "
              "--lora-targets) to choose them")  # fmt: skip
    return None


def _abstract(w: Any) -> Any:
    """A stored base weight as the model takes it: its shape and dtype."""
    return jax.ShapeDtypeStruct(w.shape, w.dtype)


def _specs(annotations: Any) -> list[Any]:
    return jax.tree.leaves(annotations, is_leaf=lambda x: isinstance(x, P))


def _key(path: str) -> str:
    """A target's name among the factors (a path's ``/`` would read as nesting)."""
    return path.replace("/", ".")


def with_lora(task: Any, rank: int, *, alpha: float | None = None, targets: str | None = None,
              seed: int = 0, initial: dict[str, tuple[Any, Any]] | None = None,
              quantize: str | None = None, dropout: float = 0.0) -> Any:  # fmt: skip
    """``task`` fine-tuned through low-rank adapters (see the module and
    :class:`LoraAdapter`): the same loss and data, the model frozen, its optimizer on the
    adapters alone."""
    import dataclasses

    import optax

    roles = _roles(task) if targets is None else None
    adapter = LoraAdapter(task.adapter, rank, alpha=alpha, targets=targets, seed=seed,
                          initial=initial, quantize=quantize, dropout=dropout,
                          roles=roles)  # fmt: skip

    masked = optax.masked(task.optimizer, adapter.trainable)
    return dataclasses.replace(task, adapter=adapter, optimizer=masked,
                               name=f"{task.name}+lora{rank}")  # fmt: skip


__all__ = ["LoraAdapter", "with_lora"]
