"""The tick loop: a schedule's :class:`~shardplug.plugin.Table` run over a stage
axis, with the backward pass written into it.

:func:`scheduled_grads` owns a training step's gradient (pp's ``compute_grads`` for the
schedules of :mod:`.schedules`). It cuts the model's own loss at its layer stack
(:mod:`.chunks`): *pre* (up to the stack: the embeddings), the stack's blocks, and *post*
(after it: the head and the loss). One ``lax.scan`` runs the table's ticks; at each:

1. *pre*, where the first chunk's F runs (its microbatch's stack input);
2. the stages, in ``jax.shard_map`` manual over the stage axis (and the replica axes), each
   running the pass its row of the table names (``lax.switch``: an idle tick computes
   nothing), after storing what arrived:

   - F: the chunk's layers, each by ``jax.vjp``; the residuals stay in a slot until its W,
     the output goes on (the last chunk's, to *post*);
   - B: the input gradient (:mod:`.backward`'s first half of each layer's pullback), sent
     back (the first chunk's, to *pre*); what W needs of it stays in a stash slot;
   - W: the weight gradient (the second half), added to the stage's;

   then one ``ppermute`` forward and one back, on the ticks where some stage sends;
3. *post* and its gradient, where the last chunk's F ran (the microbatch's loss; the gradient
   of the stack's output reaches the last stage at the next tick);
4. *pre*'s gradient, where the first chunk's B ran.

*pre* and *post* run outside the manual region, laid out by the compiler as in the rest of
the step, so every parallelism of the composition splits them as it would without pp (the
last stage's output and the first stage's input gradient leave the region, one microbatch
at a time). Each microbatch's loss is its own mean, and the step's loss and gradient their
mean over the microbatches, as gradient accumulation computes them (with a model whose loss
is a mean over its rows: the whole batch's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardplug.plugin import (
    KINDS,
    ConfigError,
    Table,
    in_microbatches,
    lay_out,
    means,
)
from shardplug.strategies.pp.chunks import Chunk, Slot, chunked, cut_at_stack, merged, unchunked
from shardplug.strategies.pp.region import (
    after,
    leaving,
    matched,
    read_slot,
    sent,
    write_if_slot,
    write_slot,
    zeros,
)
from shardplug.strategies.pp.stages import leaf_microbatches

F, B, W = KINDS["F"], KINDS["B"], KINDS["W"]

#: the name scopes of the pass each stage runs, of the tick loop's manual region and of pp's
#: own sends in it: names in a profile's trace (the program's checks read its structure)
STAGE_PASS = "stage_pass"
TICKS = "pp_ticks"
SENDS = "pp_sends"

#: the table's per-stage fields the stages read at each tick
_STAGE_FIELDS = ("kind", "chunk", "micro", "residual", "inbox", "grad", "stash",
                 "recv_forward", "recv_backward", "recv_loss", "first")  # fmt: skip
#: and those of a schedule whose messages also run the ring's other way, or stay (a V's)
_RETURNING = ("recv_forward_after", "recv_backward_before", "recv_forward_self",
              "recv_backward_self")  # fmt: skip


def scheduled_grads(
    table: Table,
    forward: Callable[..., Any],
    params: Any,
    model_state: Any,
    batch: Any,
    rng: Any,
    *,
    axis: str,
    replicas: tuple[str, ...] = (),
    replica_size: int = 1,
    remat: bool = False,
    in_place: bool = True,
) -> Any:
    """``((loss, (metrics, model_state)), grads)`` for the step, by ``table`` (see the
    module), the gradient with respect to ``params``.

    :param forward: ``forward(params, model_state, batch, rng) -> (loss, (metrics, state))``,
        the user's loss with the model bound (core's, of the prepared parameters).
    :param params: the parameters as the forward pass uses them (those of the layer stack
        best stored split over ``axis`` along their first, layer, dimension).
    :param replicas: batch axes no parameter is split over, manual in the stages (each
        device its own rows); ``replica_size``: their devices.
    :param remat: keep only each layer's input from F, its activations recomputed in B.
    :param in_place: each layer's residuals written into their slot as the layer runs (a
        GPU's engine); else a chunk's stacked and copied into the slot whole (CPU devices').
    """
    ticks = _Ticks(table, forward, params, model_state, batch, rng, axis=axis,
                   replicas=replicas, replica_size=replica_size, remat=remat,
                   in_place=in_place)  # fmt: skip
    state, state_spec = ticks.buffers()
    region = ticks.region(state_spec)
    top, weighted = ticks.totals()
    gy0 = zeros(jax.eval_shape(lambda: ticks.message(ticks.zero_x)))
    state = matched(state, {k: _like(state[k], spec) for k, spec in state_spec.items()},
                    ticks.manual)  # fmt: skip
    with in_microbatches():
        (st, _, top), _ = jax.lax.scan(lambda carry, row: ticks.tick(region, weighted, carry, row),
                                       (state, gy0, top), _rows(table))  # fmt: skip
    return ticks.gradients(st, top, weighted, params, model_state)


class _Ticks:
    """A step's tick machine (see the module): the model cut at its layer stack, the
    stages' buffers, and each tick's parts, named for what they do."""

    def __init__(self, table: Table, forward: Callable[..., Any], params: Any, model_state: Any,
                 batch: Any, rng: Any, *, axis: str, replicas: tuple[str, ...],
                 replica_size: int, remat: bool, in_place: bool = True) -> None:  # fmt: skip
        n_stages, n_local, n_micro = table.stages, table.chunks, table.microbatches
        self.in_place = in_place
        self.table, self.rng, self.axis, self.replicas = table, rng, axis, replicas
        self.n_stages, self.n_local, self.n_micro = n_stages, n_local, n_micro
        self.replica_size = replica_size
        self.treedef = jax.tree.structure(params)
        self.rows = None if not replicas else replicas[0] if len(replicas) == 1 else replicas
        self.mbs = jax.tree.map(lambda x: leaf_microbatches(x, n_micro), batch)
        cut = self.cut = cut_at_stack(forward, model_state, params, batch, rng)
        stack, self.other, layers = cut.stack, cut.other, cut.layers
        if layers % (n_stages * n_local):
            raise ConfigError(
                f"{n_stages} stages x {n_local} chunks do not divide the layer stack's {layers} "
                f"layers: choose --layers as a multiple of {n_stages * n_local}"
            )
        self.per_chunk = layers // (n_stages * n_local)
        if n_local > 1:  # each stage's share holds its V non-adjacent chunks (looped: c, c + S..)
            stack = [chunked(x, table.placement, n_stages, axis) for x in stack]
        self.stack = stack
        self.chunk = Chunk(cut, self.per_chunk, n_stages, remat, table.stage_chunks)
        self.one_way = table.one_way
        self.fields = _STAGE_FIELDS if self.one_way else (*_STAGE_FIELDS, *_RETURNING)
        self.first_stage, self.last_stage = table.placement[0], table.placement[-1]
        self.has_aux = cut.aux is not None
        self.message = cut.message
        x_aval = jax.eval_shape(lambda o: self.pre(o, 0), self.other)
        self.zero_x = zeros(x_aval)

    def pre(self, other: Any, m: Any) -> Any:
        """The model up to its layer stack, for microbatch ``m``: the stack's input."""
        return self.cut.pre(other, _pick(self.mbs, m), jax.random.fold_in(self.rng, m))

    def post(self, other: Any, m: Any, msg: Any) -> Any:
        """The model after its layer stack, and its loss, for microbatch ``m``."""
        return self.cut.post(other, _pick(self.mbs, m), jax.random.fold_in(self.rng, m), msg)

    def buffers(self) -> tuple[dict[str, Any], dict[str, P]]:
        """The buffers each stage keeps, sized from an abstract run of one layer's F and B,
        and their layouts."""
        chunk, axis, rows, n_stages = self.chunk, self.axis, self.rows, self.n_stages
        self.msg_local = msg_local = jax.eval_shape(
            lambda: self.message(_local_rows(self.zero_x, self.replica_size)))
        slots = self.table.slots

        def probe(local, msg, given):
            h, res = chunk.forward(local, 0, msg, 0, _pick(given, 0))
            _, stash = chunk.input_grad(local, 0, h, res, 0)
            return [r[None, None] for r in res], [x[None, None] for x in stash]

        self.manual = {axis, *self.replicas}
        # the blocks' rows (small) cut as the batch is, whole over the compiler's axes: each
        # stage takes its microbatch's in its pass, where a split along the microbatches is
        # gathered
        self.given = jax.tree.map(lambda x: lay_out(leaf_microbatches(x, self.n_micro),
                                                    P(None, rows)), self.cut.rows)  # fmt: skip
        res_avals, stash_avals = jax.eval_shape(
            self.in_region(probe, ([P(axis)] * len(self.stack), P(rows), P(None, rows)),
                           P(axis, rows)),
            self.stack, zeros(jax.eval_shape(lambda: self.message(self.zero_x))), self.given,
        )  # fmt: skip
        self.g_like = _layer_given(msg_local, self.has_aux, self.per_chunk)

        # Every buffer is (slots, stages, replicas, *one's shape): the region reads and writes
        # a slot by its first index, never reshaping a buffer (the squeeze of a leading (1, 1)
        # gave the loop-carried buffer another layout, copied whole on each tick).
        def slotted(count, tree):
            return jax.tree.map(
                lambda a: jnp.zeros((count, n_stages, self.replica_size, *a.shape), a.dtype), tree)

        state = {
            "inbox": slotted(slots["inbox"], msg_local),
            "grad": slotted(slots["grad"], msg_local),
            "res": [jnp.zeros((slots["residual"], *a.shape), a.dtype) for a in res_avals],
            "stash": [jnp.zeros((slots["stash"], *a.shape), a.dtype) for a in stash_avals],
            "recv_f": slotted(1, msg_local),  # from the stage before
            "recv_b": slotted(1, msg_local),  # from the stage after
            **({} if self.one_way else {"recv_s": slotted(1, msg_local)}),  # itself: a V's turn
            "acc": [jnp.zeros((self.replica_size, *x.shape), jnp.float32) for x in self.stack],
        }
        state_spec = {k: (P(rows, axis) if k == "acc" else P(None, axis, rows)) for k in state}
        return state, state_spec

    def in_region(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any
                  ) -> Callable[..., Any]:  # fmt: skip
        """``fn`` as a program manual over the stage and replica axes, its operands laid out
        for it."""
        program = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                                axis_names=self.manual, check_vma=False)  # fmt: skip

        def call(*args):
            specs = jax.tree.map(
                lambda spec, a: jax.tree.map(lambda _: spec, a), in_specs, args,
                is_leaf=lambda x: isinstance(x, P),
            )  # fmt: skip
            return program(*matched(args, specs, self.manual))

        return call

    def region(self, state_spec: dict[str, P]) -> Callable[..., Any]:
        """One tick of every stage as the manual region's program."""
        rows, msg_local = self.rows, self.msg_local
        msg_spec = jax.tree.map(lambda _: P(rows), msg_local)
        if self.has_aux:  # an aux's first dimension is layers, not rows
            msg_spec = (P(rows), jax.tree.map(lambda _: P(), msg_local[1]))
        self.row_spec = {k: P() for k in (*self.fields, "any_forward", "any_backward",
                                          "post_micro", "gx_micro")}  # fmt: skip
        x_spec = msg_spec[0] if self.has_aux else msg_spec
        return self.in_region(
            self.stages,
            ([P(self.axis)] * len(self.stack), state_spec, x_spec, msg_spec, self.row_spec,
             P(None, rows)),
            (state_spec, (x_spec, jax.tree.map(lambda _: P(), msg_local[1]))
             if self.has_aux else x_spec, x_spec),
        )  # fmt: skip

    def stages(self, local, st, x_in, gy_in, row, given):
        """One tick of every stage, inside the manual region (see the module): what arrived
        stored, the pass its row names run, the sends."""
        stage = jax.lax.axis_index(self.axis)
        me = {k: row[k][stage] for k in self.fields}
        mine = _pick(given, me["micro"])  # the blocks' rows of the microbatch F runs
        st = self.received(dict(st), me, gy_in)
        # XLA:CPU runs what does not wait on each other in any order, each device its own, so
        # the collectives of different conditionals are ordered by data: the passes after
        # pre's stack input (its collectives are every device's), each send after every pass
        # and after the send before. Only small values pass the barriers: a buffer that
        # does is copied whole each tick.
        me = after(me, x_in)
        send_f, send_b, done = self.passes(local, st, me, x_in, mine, stage)
        return self.sends(st, me, row, stage, send_f, send_b, done)

    def received(self, st: dict[str, Any], me: dict[str, Any], gy_in: Any) -> dict[str, Any]:
        """``st`` with the messages that arrived at this tick stored in their slots."""
        recv_f = read_slot(st.pop("recv_f"), 0)
        recv_b = read_slot(st.pop("recv_b"), 0)
        st["inbox"] = write_if_slot(st["inbox"], me["recv_forward"], recv_f)
        st["grad"] = write_if_slot(st["grad"], me["recv_backward"], recv_b)
        st["grad"] = write_if_slot(st["grad"], me["recv_loss"], gy_in)
        if not self.one_way:  # a V: forward messages from the stage after, gradients from before
            recv_s = read_slot(st.pop("recv_s"), 0)
            st["inbox"] = write_if_slot(st["inbox"], me["recv_forward_after"], recv_b)
            st["inbox"] = write_if_slot(st["inbox"], me["recv_forward_self"], recv_s)
            st["grad"] = write_if_slot(st["grad"], me["recv_backward_before"], recv_f)
            st["grad"] = write_if_slot(st["grad"], me["recv_backward_self"], recv_s)
        return st

    def passes(self, local, st, me, x_in, mine, stage) -> tuple[Any, Any, Any]:
        """The F, B and W passes, each where this stage's row names it: ``st``'s buffers
        updated in place; what F and B send, and a token of W's update."""
        chunk, per_chunk, msg_local = self.chunk, self.per_chunk, self.msg_local

        # Each layer's residuals are written into the slot as the layer runs, and read from it
        # a layer at a time (a chunk's stack copied whole into a slot and out of it again
        # moved each residual three more times: 1.17x accumulation's step on one H100)
        # a moment longer on CPU devices, where the in-place engine's passes met pp's sends in
        # a different order on each device of JAX 0.10's XLA:CPU and waited for each other
        # until it aborted (its ticks copy a chunk's stack into a slot and out of it)
        in_place = self.in_place

        def fwd(res):
            inbox = read_slot(st["inbox"], me["inbox"])
            start = self.message(x_in) if self.has_aux else x_in
            msg = jax.tree.map(lambda a, b: jnp.where(me["first"] > 0, a, b), start, inbox)
            if not in_place:
                out, new = chunk.forward(local, me["chunk"], msg, stage, mine)
                return write_slot(res, me["residual"], new), out
            return chunk.forward(local, me["chunk"], msg, stage, mine,
                                 into=Slot(res, me["residual"]))[::-1]  # fmt: skip

        def skip_f(res):
            return list(res), zeros(msg_local)

        def bwd(stash):
            g_msg = read_slot(st["grad"], me["grad"])
            if not in_place:
                res = read_slot(st["res"], me["residual"])
                out, new = chunk.input_grad(local, me["chunk"], g_msg, res, stage)
                return write_slot(stash, me["stash"], new), out
            out, new = chunk.input_grad(local, me["chunk"], g_msg, Slot(st["res"], me["residual"]),
                                        stage, into=Slot(stash, me["stash"]))  # fmt: skip
            return new, out

        def skip_b(stash):
            return list(stash), zeros(msg_local)

        def wgt(acc):
            slot = Slot if in_place else read_slot
            res, stash = slot(st["res"], me["residual"]), slot(st["stash"], me["stash"])
            gw = chunk.weight_grad(local, me["chunk"], res, stash, self.g_like)
            acc, start = list(acc), me["chunk"] * per_chunk
            for i, g in zip(self.cut.view, gw, strict=True):  # (replica 1, layers, ...) each
                now = jax.lax.dynamic_slice_in_dim(acc[i], start, per_chunk, 1)
                now = now + g[None].astype(jnp.float32)
                acc[i] = jax.lax.dynamic_update_slice_in_dim(acc[i], now, start, 1)
            return acc, _token(acc)

        def skip_w(acc):
            return list(acc), _token(acc)

        # Each pass a lax.cond of its own, updating its buffer in place or passing it through
        # (a switch over one state returned whole made XLA copy every buffer each tick).
        with jax.named_scope(STAGE_PASS):  # the pass each stage chooses alone
            st["res"], send_f = jax.lax.cond(me["kind"] == F, fwd, skip_f, st["res"])
            st["stash"], send_b = jax.lax.cond(me["kind"] == B, bwd, skip_b, st["stash"])
            st["acc"], done = jax.lax.cond(me["kind"] == W, wgt, skip_w, st["acc"])
        return send_f, send_b, done

    def sends(self, st, me, row, stage, send_f, send_b, done) -> tuple[Any, Any, Any]:
        """The ticks' ``ppermute`` each way, and what leaves the region: the last chunk's
        output, the first chunk's input gradient."""
        n_stages, axis = self.n_stages, self.axis
        forward_ring = [(i, (i + 1) % n_stages) for i in range(n_stages)]
        backward_ring = [((i + 1) % n_stages, i) for i in range(n_stages)]
        send_f, send_b = after((send_f, send_b), done)
        with jax.named_scope(SENDS):
            if self.one_way:  # forward messages to the stage after, gradients to the one before
                st["recv_f"] = sent(row["any_forward"], send_f, axis, forward_ring)
                send_b = after(send_b, st["recv_f"])
                st["recv_b"] = sent(row["any_backward"], send_b, axis, backward_ring)
                send_f = after(send_f, st["recv_b"])
            else:  # the stage's one message, each way: the table says who keeps it
                out = jax.tree.map(lambda f, b: jnp.where(me["kind"] == F, f, b), send_f, send_b)
                st["recv_f"] = sent(row["any_forward"], out, axis, forward_ring)
                out = after(out, st["recv_f"])
                st["recv_b"] = sent(row["any_backward"], out, axis, backward_ring)
                st["recv_s"] = jax.tree.map(lambda a: a[None, None, None], out)
                send_f, send_b = after((send_f, send_b), st["recv_b"])
            # the last chunk's output and the first chunk's input gradient leave the region
            y = leaving(row["post_micro"] >= 0, send_f, stage == self.last_stage, axis,
                         self.replicas if self.has_aux else ())  # fmt: skip
            send_b = after(send_b, y)
            gx = leaving(row["gx_micro"] >= 0, send_b[0] if self.has_aux else send_b,
                          stage == self.first_stage, axis, ())  # fmt: skip
        return st, y, gx

    def totals(self) -> tuple[dict[str, Any], bool]:
        """The sums the ticks add to (*pre*'s and *post*'s gradient, the loss, the
        metrics), and whether the loss is declared (a sum, divided once)."""
        metric_avals = jax.eval_shape(lambda o: self.post(o, 0, self.message(self.zero_x))[1],
                                      self.other)  # fmt: skip
        weighted = means.weighted(metric_avals)  # a declared loss: sums added, divided once
        if not weighted:
            means.part_means(f"{self.n_micro} microbatches of pp")
        top = {
            "other": [jnp.zeros(x.shape, jnp.float32) for x in self.other],
            "loss": jnp.zeros((), jnp.float32),
            "metrics": jax.tree.map(lambda a: jnp.zeros((), jnp.float32), metric_avals),
        }
        return top, bool(weighted)

    def tick(self, region, weighted, carry, row):
        """One tick: *pre*, the stages, *post* and its gradient, *pre*'s gradient."""
        st, gy, top = carry
        other = self.other
        x_in = jax.lax.cond(row["pre_micro"] >= 0, lambda: self.pre(other, row["pre_micro"]),
                            lambda: self.zero_x)  # fmt: skip
        with jax.named_scope(TICKS):
            st, y, gx = region(self.stack, st, x_in, gy, {k: row[k] for k in self.row_spec},
                               self.given)  # fmt: skip
        top, gy = jax.lax.cond(row["post_micro"] >= 0,
                               lambda top: self.with_post(top, row["post_micro"], y, weighted),
                               lambda top: (dict(top), zeros(gy)), top)  # fmt: skip

        def with_pre(top):
            top = dict(top)
            _, pull = jax.vjp(lambda o: self.pre(o, row["gx_micro"]), other)
            top["other"] = _add(top["other"], pull(gx)[0])
            return top

        gx = after(gx, gy)  # pre's gradient after post's, on every device alike
        top = jax.lax.cond(row["gx_micro"] >= 0, with_pre, dict, top)
        return (st, gy, top), None

    def with_post(self, top, m, y, weighted):
        """*post* of microbatch ``m`` and its pullback: its loss and metrics added, its
        parameters' gradient too; the gradient of the stack's output."""
        top, n_micro = dict(top), self.n_micro
        (loss, metrics), pull = jax.vjp(lambda o, y: self.post(o, m, y), self.other, y)
        if weighted:  # this microbatch's sums; the whole's divided by the counts below
            count = means.grad_scale(metrics)
            seed = jnp.ones((), loss.dtype) if count is None else count.astype(loss.dtype)
            loss, metrics = means.part_sums(loss, metrics)
        else:
            seed = jnp.asarray(1 / n_micro, loss.dtype)
        g_other, g_y = pull((seed, zeros(metrics)))
        share = 1 if weighted else n_micro
        top["other"] = _add(top["other"], g_other)
        top["loss"] = top["loss"] + loss.astype(jnp.float32) / share
        top["metrics"] = jax.tree.map(lambda a, b: a + b.astype(jnp.float32) / share,
                                      top["metrics"], metrics)  # fmt: skip
        return top, g_y

    def gradients(self, st, top, weighted, params, model_state) -> Any:
        """The step's ``((loss, (metrics, model_state)), grads)`` from the ticks' sums."""
        g_stack = [a.sum(0) for a in st["acc"]]  # each replica's rows' share, summed
        if self.n_local > 1:  # back in the model's order
            g_stack = [unchunked(g, self.table.placement, self.n_stages) for g in g_stack]
        grads = jax.tree.unflatten(self.treedef, merged(self.cut.stacked, g_stack, top["other"]))
        loss, metrics = top["loss"], top["metrics"]
        if weighted:
            loss, metrics = means.combine(loss, metrics, self.n_micro)
            grads = means.divided(grads, metrics, self.n_micro)
        grads = jax.tree.map(lambda g, x: g.astype(x.dtype), grads, params)
        return (loss, (metrics, model_state)), grads


def _like(tree: Any, spec: P) -> Any:
    return jax.tree.map(lambda _: spec, tree)


def _layer_given(msg_local: Any, has_aux: bool, per_chunk: int) -> Any:
    """The abstract cotangent one layer's pullback is given: its output's (and its aux's)."""
    if not has_aux:
        return (jax.ShapeDtypeStruct(msg_local.shape, msg_local.dtype),)
    h, acc = msg_local
    return (
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), acc),
    )


def _local_rows(x: jax.Array, replica_size: int) -> jax.Array:
    return jnp.zeros((x.shape[0] // replica_size, *x.shape[1:]), x.dtype)


def _token(acc: list[Any]) -> jax.Array:
    """One element of the updated gradients: what waits on it waits on the update."""
    return acc[0].reshape(-1)[0]


def _pick(mbs: Any, m: Any) -> Any:
    return jax.tree.map(lambda x: x[m], mbs)


def _add(acc: list[Any], grads: list[Any]) -> list[Any]:
    return [a + g.astype(a.dtype) for a, g in zip(acc, grads, strict=True)]


def _rows(table: Table) -> dict[str, jax.Array]:
    """The table's per-tick rows: each stage's pass and slots, and what runs outside the
    stages: whose stack input *pre* makes, whose output *post* takes, whose input gradient
    goes into *pre*'s, and whether any stage sends forward or back."""
    n_chunks = table.stages * table.chunks
    chunk = table.model_chunk
    first, last = chunk == 0, chunk == n_chunks - 1
    fields = _STAGE_FIELDS if table.one_way else (*_STAGE_FIELDS, *_RETURNING)
    out = {k: np.asarray(getattr(table, k)) for k in fields if k != "first"}
    out["chunk"] = np.maximum(table.chunk, 0)
    out["micro"] = np.maximum(table.micro, 0)
    out["first"] = (first & (table.kind == F)).astype(np.int32)

    def where(kind, at):
        return np.where((table.kind == kind) & at, table.micro, -1).max(axis=1)

    out["pre_micro"] = where(F, first)
    out["post_micro"] = where(F, last)
    out["gx_micro"] = where(B, first)
    out["any_forward"] = table.sending["after"].astype(np.int32)
    out["any_backward"] = table.sending["before"].astype(np.int32)
    return {k: jnp.asarray(v, jnp.int32) for k, v in out.items()}


__all__ = ["math", "scheduled_grads"]
