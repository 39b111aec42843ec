"""A training step cut at its layer stack, and the three passes of a chunk of its layers.

:func:`cut_at_stack` traces the user's loss with the layer stack's operation answering
differently, into *pre* (up to the stack: the embeddings), the stack's block, and *post*
(after it: the head and the loss), each a function of the parameters and one microbatch.
:class:`Chunk` runs a chunk of G consecutive layers of the stack: ``forward`` (F: each
layer by ``jax.vjp``, its residuals kept), ``input_grad`` (B) and ``weight_grad`` (W), the two
halves of each layer's pullback (:mod:`shardplug.strategies.pp.backward`). The tick loop of
:mod:`shardplug.strategies.pp.ticks` runs them as a schedule says.

What passes between the stages (a *message*) is the stack's running input ``h`` or, where
the blocks return an aux (a mixture of experts' tallies), ``(h, aux of every layer)``, each
chunk writing its own layers' rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardplug.plugin import (
    ConfigError,
    Unscheduled,
    in_microbatches,
    lay_out,
    override_operation,
    split_aux,
)
from shardplug.strategies.pp import backward

#: why a model that runs its stacked layers in a loop of its own cannot be cut into stages
NEVER_RAN = (
    "this model never called shardplug.stack: layers it applies with its own loop (a "
    "lax.scan over its stacked leaves) cannot be cut into stages; call "
    "shardplug.stack.scan(block, layers, x) in place of that loop"
)


@dataclasses.dataclass(frozen=True)
class StackCut:
    """The user's loss cut at its layer stack (:func:`cut_at_stack`)."""

    run: Callable[..., Any]  # (stack op, stack leaves, other leaves, data, key) -> forward's
    stacked: list[bool]  # which of the parameters' leaves the stack operation is given
    stack: list[Any]  # those leaves (leading dimension: the layers)
    other: list[Any]  # the rest
    block: Callable[..., Any]  # one layer: block(layer params, h, rows) -> h or (h, aux)
    view: list[int]  # the stack operation's parameter leaves, as indices into ``stack``
    tree: Any  # their tree
    aux: Any  # one layer's aux (its shape), None where the blocks return none
    layers: int
    rows: Any  # the whole batch's row inputs of the blocks (empty where none)

    def pre(self, other: list[Any], data: Any, key: Any) -> jax.Array:
        """The stack's input for one microbatch."""
        got = {}

        def op(block, sp, x, *, layers, rows):
            got["x"] = x
            return _placeholder(x, self.aux, layers)

        self.run(op, self.stack, other, data, key)
        return got["x"]

    def post(self, other: list[Any], data: Any, key: Any, msg: Any) -> tuple[Any, Any]:
        """The loss and metrics of one microbatch, given the stack's output ``msg``."""
        loss, (metrics, _) = self.run(lambda *a, **k: msg, self.stack, other, data, key)
        return loss, metrics

    def message(self, h: Any) -> Any:
        """A message starting from the stack input ``h``: no layer's aux yet."""
        if self.aux is None:
            return h
        return (h, jax.tree.map(lambda a: jnp.zeros((self.layers, *a.shape), a.dtype), self.aux))


def cut_at_stack(forward, model_state, params, batch, rng) -> StackCut:
    """Cut ``forward(params, model_state, batch, rng)`` at its layer stack: one trace of the
    whole batch (what the block closes over is the batch's, as under the stack's own
    operation) finds the block, which of ``params``' leaves the stack operation is given
    (stored split over the stages or not: each stage takes its layers of each), and what the
    blocks return. Refuses, in one line, what the schedules cannot run: two stacks, none, a
    stack of computed parameters or per-layer state, a model that updates its state from
    the batch."""
    leaves, treedef = jax.tree.flatten(params)

    def runner(stacked):
        def run(op, stack_leaves, other_leaves, data, key):
            full = jax.tree.unflatten(treedef, merged(stacked, stack_leaves, other_leaves))
            with override_operation("layer_stack", op), in_microbatches():
                return forward(full, model_state, data, key)

        return run

    seen: dict[str, Any] = {}

    def capture(block, sp, x, *, layers, rows):
        if seen:
            raise Unscheduled(
                "pp's schedules run one layer stack per step; this model runs two: use -o "
                "pp.schedule=gpipe"
            )
        first = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), sp)
        _, aux = jax.eval_shape(lambda w, h: split_aux(block(w, h, rows)), first, x)
        if _offloads(lambda w, h: block(w, h, rows), first, x):
            raise Unscheduled(
                "pp's 1F1B and zero-bubble schedules keep each stage's residuals in device "
                "buffers, and this block moves them to host memory (--remat offload): use -o "
                "pp.schedule=gpipe"
            )
        seen.update(block=block, sp=sp, aux=aux, layers=layers, rows=rows)
        return _placeholder(x, aux, layers)

    _, (_, new_state) = runner([False] * len(leaves))(capture, [], leaves, batch, rng)
    if not seen:
        raise ConfigError(f"pp's schedules split a layer stack, and {NEVER_RAN}")
    old, new = jax.tree.leaves(model_state), jax.tree.leaves(new_state)
    if len(old) != len(new) or any(a is not b for a, b in zip(old, new, strict=False)):
        raise Unscheduled(
            "pp's 1F1B and zero-bubble schedules compute each microbatch's loss as its "
            "gradient comes back, and this model updates its state from the batch (batch "
            "statistics, a router's balancing bias): use -o pp.schedule=gpipe"
        )
    given, tree = jax.tree.flatten(seen["sp"])
    mine = {id(w) for w in given}
    stacked = [id(w) in mine for w in leaves]
    stack = [w for w, s in zip(leaves, stacked, strict=True) if s]
    ids = {id(w): i for i, w in enumerate(stack)}
    if any(id(w) not in ids for w in given):
        raise Unscheduled(
            "pp's schedules need the layer stack's parameters as the model stores them; this "
            "model computes them, or passes its stack per-layer state: use -o "
            "pp.schedule=gpipe"
        )
    other = [w for w, s in zip(leaves, stacked, strict=True) if not s]
    view = [ids[id(w)] for w in given]
    return StackCut(runner(stacked), stacked, stack, other, seen["block"], view, tree,
                    seen["aux"], seen["layers"], seen["rows"])  # fmt: skip


def _offloads(block: Any, w: Any, x: Any) -> bool:
    """Whether ``block`` keeps any residual for its backward pass in host memory."""

    def residuals(w, h):
        return jax.tree.leaves(jax.vjp(block, w, h)[1])

    host = jax.memory.Space.Host
    return any(a.memory_space == host for a in jax.make_jaxpr(residuals)(w, x).out_avals)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Buffers of ``(slots, 1, 1, layers, *one layer's value)`` and the slot a pass reads or
    writes: each layer's value goes straight to its row as the layer runs, and comes
    straight from it, never a chunk's stack of them copied whole into (or out of) a slot."""

    buffers: list[Any]
    slot: Any

    def written(self, buffers: list[Any], j: Any, values: list[Any]) -> list[Any]:
        """``values`` (layer ``j``'s) into ``buffers`` (a scan's carry) at the slot."""
        at = jnp.maximum(self.slot, 0)
        return [
            jax.lax.dynamic_update_slice(
                b, v.astype(b.dtype)[None, None, None, None], (at, 0, 0, j, *(0,) * v.ndim)
            )
            for b, v in zip(buffers, values, strict=True)
        ]

    def read(self, j: Any) -> list[Any]:
        """Layer ``j``'s values, from the slot."""
        at = jnp.maximum(self.slot, 0)
        return [
            jax.lax.dynamic_slice(b, (at, 0, 0, j, *(0,) * (b.ndim - 4)),
                                  (1, 1, 1, 1, *b.shape[4:]))[0, 0, 0, 0]
            for b in self.buffers
        ]  # fmt: skip


class Chunk:
    """F, B and W of a chunk of ``size`` layers on a stage (see the module); with ``remat``,
    F keeps only each layer's input and B recomputes the rest. ``placed``: each stage's
    chunks (their numbers in the model), in its local order."""

    def __init__(self, cut: StackCut, size: int, stages: int, remat: bool,
                 placed: list[list[int]]):  # fmt: skip
        self.cut, self.size, self.stages = cut, size, stages
        looped = all(c == k * stages + s for s, mine in enumerate(placed)
                     for k, c in enumerate(mine))  # fmt: skip
        self.placed = None if looped else placed
        block = cut.block
        if remat:
            block = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
        self.block = block
        self.pull: dict[str, Any] = {}  # a layer's pullback: its tree, where its weights are

    def params(self, local: list[Any], k: Any) -> Any:
        """The stack operation's parameters for the stage's local chunk ``k``."""
        per_chunk = self.size
        return jax.tree.unflatten(
            self.cut.tree,
            [
                jax.lax.dynamic_slice_in_dim(local[i], k * per_chunk, per_chunk, 0)
                for i in self.cut.view
            ],
        )

    def first_layer(self, k: Any, stage: Any) -> Any:
        """The model's index of the first layer of the stage's local chunk ``k``."""
        if self.placed is None:  # looped: chunk k * S + stage
            return (k * self.stages + stage) * self.size
        return jnp.asarray(self.placed, jnp.int32)[stage, k] * self.size

    def forward(self, local, k, msg, stage, rows, into: Slot | None = None
                ) -> tuple[Any, list[Any]]:  # fmt: skip
        """F: the chunk's output message and its layers' residuals (stacked per layer; a
        layer's own weights left out: :meth:`_leaves` puts them back); ``rows``: the
        microbatch's row inputs of the blocks. ``into``: buffers each layer's residuals are
        written into as the layer runs (returned in place of the stack)."""

        def layer(carry, inputs):
            h, kept = carry if into is not None else (carry, None)
            w, j = inputs
            y, pull = jax.vjp(lambda w, h: self.block(w, h, rows), w, h)
            res, tree = jax.tree.flatten(pull)
            mine = {id(x): i for i, x in enumerate(jax.tree.leaves(w))}
            where = tuple(mine.get(id(r), -1) for r in res)  # -1: kept, else the weight's
            self.pull.update(tree=tree, where=where)
            h, aux = split_aux(y)
            res = [r for r, i in zip(res, where, strict=True) if i < 0]
            if into is None:
                return h, (res, aux)
            return (h, into.written(kept, j, res)), aux

        h, acc = msg if self.cut.aux is not None else (msg, None)
        xs = (self.params(local, k), jnp.arange(self.size))
        if into is None:
            h, (res, aux) = jax.lax.scan(layer, h, xs)
        else:
            (h, res), aux = jax.lax.scan(layer, (h, list(into.buffers)), xs)
        if acc is None:
            return h, res
        first = self.first_layer(k, stage)
        acc = jax.tree.map(
            lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), first, 0),
            acc,
            aux,
        )
        return (h, acc), res

    def input_grad(self, local, k, g_msg, res, stage, into: Slot | None = None
                   ) -> tuple[Any, list[Any]]:  # fmt: skip
        """B: the gradient of the chunk's input message, and the stash W needs. ``res``:
        the layers' residuals stacked, or the :class:`Slot` they were written into;
        ``into``: buffers each layer's stash is written into (returned in its place)."""
        aux = self.cut.aux is not None
        g_h, g_acc = g_msg if aux else (g_msg, None)
        g_aux = None
        if aux:
            first = self.first_layer(k, stage)
            g_aux = jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, first, self.size, 0), g_acc
            )

        def layer(carry, inputs):
            g, kept_stash = carry if into is not None else (carry, None)
            w, r, ga, j = inputs
            r = res.read(j) if isinstance(res, Slot) else r
            kept = self._leaves(r, w)
            given = (g, ga) if aux else (g,)
            gx, stash = backward.input_grads(self._cut(kept, given), kept, jax.tree.leaves(given))
            if into is None:
                return gx[0], stash
            return (gx[0], into.written(kept_stash, j, stash)), None

        layers = jnp.arange(self.size)
        stacked = None if isinstance(res, Slot) else res
        xs = (self.params(local, k), stacked, g_aux, layers)
        if into is None:
            g_h, stash = jax.lax.scan(layer, g_h, xs, reverse=True)
        else:
            (g_h, stash), _ = jax.lax.scan(layer, (g_h, list(into.buffers)), xs, reverse=True)
        return ((g_h, g_acc) if aux else g_h), stash

    def weight_grad(self, local, k, res, stash, given) -> list[Any]:
        """W: the gradient of each of the stack operation's parameter leaves, (G, ...);
        ``res`` and ``stash`` stacked, or the :class:`Slot` each was written into;
        ``given``: one layer's output gradient, its shape alone."""

        def layer(_, inputs):
            w, r, st, j = inputs
            r = res.read(j) if isinstance(res, Slot) else r
            st = stash.read(j) if isinstance(stash, Slot) else st
            kept = self._leaves(r, w)
            return None, backward.weight_grads(self._cut(kept, given), kept, st)

        xs = (self.params(local, k), None if isinstance(res, Slot) else res,
              None if isinstance(stash, Slot) else stash, jnp.arange(self.size))  # fmt: skip
        _, gw = jax.lax.scan(layer, None, xs)
        return gw

    def _leaves(self, res: list[Any], w: Any) -> list[Any]:
        """A layer's pullback leaves: its kept residuals with its weights put back."""
        kept, weights = iter(res), jax.tree.leaves(w)
        return [next(kept) if i < 0 else weights[i] for i in self.pull["where"]]

    def _cut(self, leaves: list[Any], given: Any) -> backward.Cut:
        def pullback(leaves, g):
            g = g if self.cut.aux is not None else g[0]
            return jax.tree.unflatten(self.pull["tree"], leaves)(g)

        # traced on the given gradient's shape alone, as W has it: B's tracer (of the
        # region's mesh) and W's bare shape gave the pullback other equations, and B's stash
        # another length than W reads
        given = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype), given)
        return backward.cut(pullback, leaves, given)[0]


def _placeholder(x: Any, aux: Any, layers: int) -> Any:
    """A stack's output of the right shape, where its value is not used."""
    if aux is None:
        return jnp.zeros_like(x)
    return jnp.zeros_like(x), jax.tree.map(lambda a: jnp.zeros((layers, *a.shape), a.dtype), aux)


def merged(stacked: list[bool], stack: list[Any], other: list[Any]) -> list[Any]:
    """The leaves of the stack and of the rest back in one list, as ``stacked`` flags them."""
    it_s, it_o = iter(stack), iter(other)
    return [next(it_s) if s else next(it_o) for s in stacked]


def chunked(x: jax.Array, placement: tuple[int, ...], n_stages: int, axis: str) -> jax.Array:
    """A stacked leaf reordered so that stage ``s``'s contiguous share holds its V chunks (of
    L/(V*S) layers each), one of each round of S: looped, chunks ``s, s + S, ...``; in a
    V, round ``r``'s reversed where ``r`` is odd (a send of one chunk's share more)."""
    n_local = len(placement) // n_stages
    per_chunk = x.shape[0] // len(placement)
    x = x.reshape(n_local, n_stages, per_chunk, *x.shape[1:]).swapaxes(0, 1)
    x = lay_out(x, P(axis, *([P.UNCONSTRAINED] * (x.ndim - 1))))
    x = _by_round(x, [_round_positions(placement, n_stages, r) for r in range(n_local)])
    return x.reshape(n_stages * n_local * per_chunk, *x.shape[3:])


def unchunked(g: jax.Array, placement: tuple[int, ...], n_stages: int) -> jax.Array:
    """A stacked gradient in :func:`chunked`'s order back in the model's."""
    n_local = len(placement) // n_stages
    per_chunk = g.shape[0] // len(placement)
    g = g.reshape(n_stages, n_local, per_chunk, *g.shape[1:])
    back = [np.argsort(_round_positions(placement, n_stages, r)) for r in range(n_local)]
    return _by_round(g, back).swapaxes(0, 1).reshape(n_stages * n_local * per_chunk, *g.shape[3:])


def _round_positions(placement: tuple[int, ...], n_stages: int, r: int) -> list[int]:
    """For each stage, the position in round ``r`` of the chunk it holds (the rounds of a
    placement each put one chunk on every stage: :func:`shardplug.plugin.tabulate`)."""
    mine = placement[r * n_stages : (r + 1) * n_stages]
    return [mine.index(d) for d in range(n_stages)]


def _by_round(x: jax.Array, positions: list[Any]) -> jax.Array:
    """``x`` (stages, rounds, ...) with each round's stages taken from ``positions``: as they
    are, reversed (one send), or in another order."""
    n_stages = x.shape[0]
    if all(list(p) == list(range(n_stages)) for p in positions):
        return x
    rounds = []
    for r, p in enumerate(positions):
        if list(p) == list(range(n_stages)):
            rounds.append(x[:, r])
        elif list(p) == list(range(n_stages))[::-1]:
            rounds.append(jnp.flip(x[:, r], 0))
        else:
            rounds.append(x[np.asarray(p), r])
    return jnp.stack(rounds, axis=1)
