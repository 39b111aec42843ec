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
from shardplug.strategies.pp.chunks import Chunk, cut_at_stack, merged
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
    """
    n_stages, n_local, n_micro = table.stages, table.chunks, table.microbatches
    treedef = jax.tree.structure(params)
    rows = None if not replicas else replicas[0] if len(replicas) == 1 else replicas
    mbs = jax.tree.map(lambda x: leaf_microbatches(x, n_micro), batch)
    cut = cut_at_stack(forward, model_state, params, batch, rng)
    stack, other, layers = cut.stack, cut.other, cut.layers
    if layers % (n_stages * n_local):
        raise ConfigError(
            f"{n_stages} stages x {n_local} chunks do not divide the layer stack's {layers} "
            f"layers: choose --layers as a multiple of {n_stages * n_local}"
        )
    per_chunk = layers // (n_stages * n_local)
    if n_local > 1:  # each stage's share holds its V non-adjacent chunks (looped: c, c + S..)
        stack = [_chunked(x, table.placement, n_stages, axis) for x in stack]
    chunk = Chunk(cut, per_chunk, n_stages, remat, table.stage_chunks)
    one_way = table.one_way
    fields = _STAGE_FIELDS if one_way else (*_STAGE_FIELDS, *_RETURNING)
    first_stage, last_stage = table.placement[0], table.placement[-1]
    has_aux = cut.aux is not None
    message = cut.message

    def pre(other, m):
        return cut.pre(other, _pick(mbs, m), jax.random.fold_in(rng, m))

    def post(other, m, msg):
        return cut.post(other, _pick(mbs, m), jax.random.fold_in(rng, m), msg)

    x_aval = jax.eval_shape(lambda o: pre(o, 0), other)
    zero_x = zeros(x_aval)

    # ---- the buffers each stage keeps, from an abstract run of one layer's F and B ----
    msg_local = jax.eval_shape(lambda: message(_local_rows(zero_x, replica_size)))
    slots = table.slots

    def probe(local, msg, given):
        h, res = chunk.forward(local, 0, msg, 0, _pick(given, 0))
        _, stash = chunk.input_grad(local, 0, h, res, 0)
        return [r[None, None] for r in res], [x[None, None] for x in stash]

    manual = {axis, *replicas}
    # the blocks' rows (small) cut as the batch is, whole over the compiler's axes: each stage
    # takes its microbatch's in its pass, where a split along the microbatches is gathered
    given = jax.tree.map(lambda x: lay_out(leaf_microbatches(x, n_micro), P(None, rows)), cut.rows)

    def in_region(fn, in_specs, out_specs):
        """``fn`` as a program manual over the stage and replica axes, its operands laid out
        for it."""
        program = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=manual,
                                check_vma=False)  # fmt: skip

        def call(*args):
            specs = jax.tree.map(
                lambda spec, a: jax.tree.map(lambda _: spec, a), in_specs, args,
                is_leaf=lambda x: isinstance(x, P),
            )  # fmt: skip
            return program(*matched(args, specs, manual))

        return call

    res_avals, stash_avals = jax.eval_shape(
        in_region(probe, ([P(axis)] * len(stack), P(rows), P(None, rows)), P(axis, rows)),
        stack,
        zeros(jax.eval_shape(lambda: message(zero_x))),
        given,
    )
    g_like = _layer_given(msg_local, has_aux, per_chunk)

    # Every buffer is (slots, stages, replicas, *one's shape): the region reads and writes a
    # slot by its first index, never reshaping a buffer (the squeeze of a leading (1, 1)
    # gave the loop-carried buffer another layout, copied whole on each tick).
    def slotted(count, tree):
        return jax.tree.map(lambda a: jnp.zeros((count, n_stages, replica_size, *a.shape), a.dtype),
                            tree)  # fmt: skip

    state = {
        "inbox": slotted(slots["inbox"], msg_local),
        "grad": slotted(slots["grad"], msg_local),
        "res": [jnp.zeros((slots["residual"], *a.shape), a.dtype) for a in res_avals],
        "stash": [jnp.zeros((slots["stash"], *a.shape), a.dtype) for a in stash_avals],
        "recv_f": slotted(1, msg_local),  # from the stage before
        "recv_b": slotted(1, msg_local),  # from the stage after
        **({} if one_way else {"recv_s": slotted(1, msg_local)}),  # from itself: a V's turn
        "acc": [jnp.zeros((replica_size, *x.shape), jnp.float32) for x in stack],
    }
    state_spec = {k: (P(rows, axis) if k == "acc" else P(None, axis, rows)) for k in state}
    msg_spec = jax.tree.map(lambda _: P(rows), msg_local)
    if has_aux:  # an aux's first dimension is layers, not rows
        msg_spec = (P(rows), jax.tree.map(lambda _: P(), msg_local[1]))

    def stages(local, st, x_in, gy_in, row, given):
        """One tick of every stage, inside the manual region (see the module)."""
        stage = jax.lax.axis_index(axis)
        me = {k: row[k][stage] for k in fields}
        mine = _pick(given, me["micro"])  # the blocks' rows of the microbatch F runs
        st = dict(st)
        recv_f = read_slot(st.pop("recv_f"), 0)
        recv_b = read_slot(st.pop("recv_b"), 0)
        st["inbox"] = write_if_slot(st["inbox"], me["recv_forward"], recv_f)
        st["grad"] = write_if_slot(st["grad"], me["recv_backward"], recv_b)
        st["grad"] = write_if_slot(st["grad"], me["recv_loss"], gy_in)
        if not one_way:  # a V: forward messages from the stage after, gradients from before
            recv_s = read_slot(st.pop("recv_s"), 0)
            st["inbox"] = write_if_slot(st["inbox"], me["recv_forward_after"], recv_b)
            st["inbox"] = write_if_slot(st["inbox"], me["recv_forward_self"], recv_s)
            st["grad"] = write_if_slot(st["grad"], me["recv_backward_before"], recv_f)
            st["grad"] = write_if_slot(st["grad"], me["recv_backward_self"], recv_s)

        def fwd(res):
            inbox = read_slot(st["inbox"], me["inbox"])
            start = message(x_in) if has_aux else x_in
            msg = jax.tree.map(lambda a, b: jnp.where(me["first"] > 0, a, b), start, inbox)
            out, new = chunk.forward(local, me["chunk"], msg, stage, mine)
            return write_slot(res, me["residual"], new), out

        def skip_f(res):
            return list(res), zeros(msg_local)

        def bwd(stash):
            res = read_slot(st["res"], me["residual"])
            g_msg = read_slot(st["grad"], me["grad"])
            out, new = chunk.input_grad(local, me["chunk"], g_msg, res, stage)
            return write_slot(stash, me["stash"], new), out

        def skip_b(stash):
            return list(stash), zeros(msg_local)

        def wgt(acc):
            res = read_slot(st["res"], me["residual"])
            stash = read_slot(st["stash"], me["stash"])
            gw = chunk.weight_grad(local, me["chunk"], res, stash, g_like)
            acc, start = list(acc), me["chunk"] * per_chunk
            for i, g in zip(cut.view, gw, strict=True):  # (replica 1, layers, ...) each
                now = jax.lax.dynamic_slice_in_dim(acc[i], start, per_chunk, 1)
                now = now + g[None].astype(jnp.float32)
                acc[i] = jax.lax.dynamic_update_slice_in_dim(acc[i], now, start, 1)
            return acc, _token(acc)

        def skip_w(acc):
            return list(acc), _token(acc)

        # XLA:CPU runs what does not wait on each other in any order, each device its own, so
        # the collectives of different conditionals are ordered by data: the passes after
        # pre's stack input (its collectives are every device's), each send after every pass
        # and after the send before. Only small values pass the barriers: a buffer that
        # does is copied whole each tick.
        me = after(me, x_in)
        # Each pass a lax.cond of its own, updating its buffer in place or passing it through
        # (a switch over one state returned whole made XLA copy every buffer each tick).
        with jax.named_scope(STAGE_PASS):  # the pass each stage chooses alone
            st["res"], send_f = jax.lax.cond(me["kind"] == F, fwd, skip_f, st["res"])
            st["stash"], send_b = jax.lax.cond(me["kind"] == B, bwd, skip_b, st["stash"])
            st["acc"], done = jax.lax.cond(me["kind"] == W, wgt, skip_w, st["acc"])
        forward_ring = [(i, (i + 1) % n_stages) for i in range(n_stages)]
        backward_ring = [((i + 1) % n_stages, i) for i in range(n_stages)]
        send_f, send_b = after((send_f, send_b), done)
        with jax.named_scope(SENDS):
            if one_way:  # forward messages to the stage after, gradients to the one before
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
            y = leaving(row["post_micro"] >= 0, send_f, stage == last_stage, axis,
                         replicas if has_aux else ())  # fmt: skip
            send_b = after(send_b, y)
            gx = leaving(row["gx_micro"] >= 0, send_b[0] if has_aux else send_b,
                          stage == first_stage, axis, ())  # fmt: skip
        return st, y, gx

    row_spec = {k: P() for k in (*fields, "any_forward", "any_backward", "post_micro",
                                 "gx_micro")}  # fmt: skip
    x_spec = msg_spec[0] if has_aux else msg_spec
    region = in_region(
        stages,
        ([P(axis)] * len(stack), state_spec, x_spec, msg_spec, row_spec, P(None, rows)),
        (state_spec, (x_spec, jax.tree.map(lambda _: P(), msg_local[1]))
         if has_aux else x_spec, x_spec),
    )  # fmt: skip

    metric_avals = jax.eval_shape(lambda o: post(o, 0, message(zero_x))[1], other)
    weighted = means.weighted(metric_avals)  # a declared loss: sums added, divided once
    if not weighted:
        means.part_means(f"{n_micro} microbatches of pp")

    def tick(carry, row):
        st, gy, top = carry
        x_in = jax.lax.cond(row["pre_micro"] >= 0, lambda: pre(other, row["pre_micro"]),
                            lambda: zero_x)  # fmt: skip
        with jax.named_scope(TICKS):
            st, y, gx = region(stack, st, x_in, gy, {k: row[k] for k in row_spec}, given)

        def with_post(top):
            top = dict(top)
            m = row["post_micro"]
            (loss, metrics), pull = jax.vjp(lambda o, y: post(o, m, y), other, y)
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

        top, gy = jax.lax.cond(row["post_micro"] >= 0, with_post,
                               lambda top: (dict(top), zeros(gy)), top)  # fmt: skip

        def with_pre(top):
            top = dict(top)
            _, pull = jax.vjp(lambda o: pre(o, row["gx_micro"]), other)
            top["other"] = _add(top["other"], pull(gx)[0])
            return top

        gx = after(gx, gy)  # pre's gradient after post's, on every device alike
        top = jax.lax.cond(row["gx_micro"] >= 0, with_pre, dict, top)
        return (st, gy, top), None

    top = {
        "other": [jnp.zeros(x.shape, jnp.float32) for x in other],
        "loss": jnp.zeros((), jnp.float32),
        "metrics": jax.tree.map(lambda a: jnp.zeros((), jnp.float32), metric_avals),
    }
    gy0 = zeros(jax.eval_shape(lambda: message(zero_x)))
    state = matched(state, {k: _like(state[k], spec) for k, spec in state_spec.items()}, manual)
    with in_microbatches():
        (st, _, top), _ = jax.lax.scan(tick, (state, gy0, top), _rows(table))
    g_stack = [a.sum(0) for a in st["acc"]]  # each replica's rows' share, summed
    if n_local > 1:  # back in the model's order
        g_stack = [_unchunked(g, table.placement, n_stages) for g in g_stack]
    grads = jax.tree.unflatten(treedef, merged(cut.stacked, g_stack, top["other"]))
    loss, metrics = top["loss"], top["metrics"]
    if weighted:
        loss, metrics = means.combine(loss, metrics, n_micro)
        grads = means.divided(grads, metrics, n_micro)
    grads = jax.tree.map(lambda g, x: g.astype(x.dtype), grads, params)
    return (loss, (metrics, model_state)), grads


def _like(tree: Any, spec: P) -> Any:
    return jax.tree.map(lambda _: spec, tree)


def _chunked(x: jax.Array, placement: tuple[int, ...], n_stages: int, axis: str) -> jax.Array:
    """A stacked leaf reordered so that stage ``s``'s contiguous share holds its V chunks (of
    L/(V*S) layers each), one of each round of S: looped, chunks ``s, s + S, ...``; in a
    V, round ``r``'s reversed where ``r`` is odd (a send of one chunk's share more)."""
    n_local = len(placement) // n_stages
    per_chunk = x.shape[0] // len(placement)
    x = x.reshape(n_local, n_stages, per_chunk, *x.shape[1:]).swapaxes(0, 1)
    x = lay_out(x, P(axis, *([P.UNCONSTRAINED] * (x.ndim - 1))))
    x = _by_round(x, [_round_positions(placement, n_stages, r) for r in range(n_local)])
    return x.reshape(n_stages * n_local * per_chunk, *x.shape[3:])


def _unchunked(g: jax.Array, placement: tuple[int, ...], n_stages: int) -> jax.Array:
    """A stacked gradient in :func:`_chunked`'s order back in the model's."""
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
