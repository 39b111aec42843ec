"""Building blocks of pipeline parallelism: a layer stack's layers split over a stage axis.

:class:`Pipeline` is a schedule's plan (stages, microbatches, repeats, the replica axes),
:func:`gpipe` runs a layer stack by it (GPipe's schedule, circular with repeats), inside
``jax.shard_map``, manual over the stage axis (and the replica axes) only, so the other axes
stay the compiler's. ``pp`` supplies the layer stack operation with it
(:func:`stack_operation`, as :class:`shardplug.plugin.Operations`); the tick loop
(:mod:`.ticks`) builds on :func:`microbatches`, :func:`circular_order` and :func:`rows_split`.

**The schedule.** The batch is cut into M microbatches (rows ``m, m+M, ...``, so each stays
spread over the batch axes). The L layers are R*S groups of G = L/(R*S) consecutive layers;
stage ``s`` holds groups ``s, s+S, ..., s+(R-1)S`` (GPipe: R = 1, one group of L/S). Stage
``s`` works on unit ``u = t - s`` at tick ``t`` (unit ``u`` is repeat ``u // M`` of
microbatch ``u % M``), so a unit's input is what stage ``s-1`` sent at the tick before
(``ppermute``, one per tick); stage 0 takes microbatch ``m`` in its first repeat and what
the last stage sent back round the ring for ``m`` in the later ones. R*M + S - 1 ticks in
all, (S-1) of them idle on each stage: the bubble is (S-1)/(R*M+S-1). The backward pass is
autodiff through the schedule (the permutes reversed). Each tick's stage computation is
rematerialised by default, so a stage keeps its inputs per tick, not every activation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardplug.plugin import (
    ConfigError,
    Unscheduled,
    in_microbatches,
    is_explicit,
    lay_out,
    split_aux,
)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule: the stage axis, its size, microbatches, repeats, remat."""

    axis: str
    stages: int
    microbatches: int
    repeats: int = 1
    remat: bool = True
    #: batch axes no parameter is split over: manual in the schedule, each device's rows its
    #: own, so the stack's gradient is summed over them once, not once per tick
    replicas: tuple[str, ...] = ()
    #: their devices, all together
    replica_size: int = 1

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage's ticks: (S-1)/(R*M+S-1)."""
        s, m, r = self.stages, self.microbatches, self.repeats
        return (s - 1) / (r * m + s - 1)

    def split_over(self, devices: int) -> Pipeline:
        """This schedule for a batch whose rows are laid out over ``devices`` by its type
        (explicit axes): every microbatch's rows must split over them too."""
        if devices <= self.replica_size:
            return self
        return dataclasses.replace(self, replica_size=devices)

    def resolve(self, batch: int | None) -> Pipeline:
        """This schedule with its microbatch count chosen for ``batch`` rows where it was
        left to choose (0): 4 x stages, or the largest divisor of the batch below that (a
        multiple of the stages for the circular schedule)."""
        if self.microbatches or batch is None:
            return self
        step = self.stages if self.repeats > 1 else 1
        fits = [
            m for m in range(step, 4 * self.stages + 1, step)
            if batch % m == 0 and (batch // m) % self.replica_size == 0
        ]  # fmt: skip
        return dataclasses.replace(self, microbatches=max(fits) if fits else self.stages)

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    def check(self, layers: int, batch: int) -> None:
        """Refuse, in one line each, a stack or batch this schedule cannot split."""
        s, m, r = self.stages, self.microbatches, self.repeats
        if layers % (s * r):
            what = f"{s} stages" if r == 1 else f"{s} stages x {r} repeats"
            raise ConfigError(
                f"{what} do not divide the layer stack's {layers} layers: choose --layers as a "
                f"multiple of {s * r}, or another stage count (--mesh stage=N) or repeats"
            )
        if batch % m:
            raise ConfigError(
                f"{m} microbatches do not divide the batch of {batch}: choose -o "
                f"microbatches=M with M dividing {batch}"
            )
        if (batch // m) % self.replica_size:
            raise ConfigError(
                f"a microbatch of {batch // m} rows does not split over the "
                f"{self.replica_size} devices of {', '.join(self.replicas) or 'the batch'}: "
                f"choose fewer "
                f"microbatches (-o microbatches=M) or a larger batch"
            )
        if r > 1 and m % s:
            raise ConfigError(
                f"the circular schedule (repeats={r}) needs microbatches a multiple of the "
                f"{s} stages, got {m}: use -o microbatches={s * max(1, m // s)}"
            )


def stack_operation(pipeline: Pipeline):
    """The layer stack operation of ``pipeline``: its microbatches chosen for each batch, the
    stack and batch checked (one line each), the schedule run, seeing microbatches."""

    def run(block, params, x, *, layers, rows):
        plan = pipeline.split_over(rows_split(x)).resolve(x.shape[0])
        plan.check(layers, x.shape[0])
        with in_microbatches():
            return gpipe(block, params, x, plan, layers, rows)

    return run


def circular_order(layers: int, stages: int, repeats: int) -> jnp.ndarray:
    """The layer indices in the order the stage axis stores them for the circular schedule:
    stage ``s``'s contiguous share holds groups ``s, s+S, ...`` (identity when R = 1)."""
    g = layers // (stages * repeats)
    idx = jnp.arange(layers).reshape(repeats, stages, g)
    return idx.transpose(1, 0, 2).reshape(-1)


def gpipe(block, params, x, pl: Pipeline, layers: int, rows: Any):
    """Run ``block`` over the stack ``params`` on ``x`` by the schedule (see the module).
    A block returning ``(x, aux)`` gives ``(x, aux)``: each layer's aux summed over the
    microbatches (and the replicas), stacked over the layers in their order. ``rows`` (the
    stack's row inputs) are cut into microbatches as ``x`` is, and each stage gives its
    blocks those of the microbatch it runs, ``block(w, h, rows)``."""
    n_stages, n_micro, n_repeats = pl.stages, pl.microbatches, pl.repeats
    per_chunk = layers // (n_stages * n_repeats)
    if n_repeats > 1:  # each stage's share must hold its R non-adjacent groups: reorder the stack

        def reorder(w):
            w = w.reshape(n_repeats, n_stages, per_chunk, *w.shape[1:]).swapaxes(0, 1)
            w = lay_out(w, P(pl.axis, *([P.UNCONSTRAINED] * (w.ndim - 1))))
            return w.reshape(layers, *w.shape[3:])

        params = jax.tree.map(reorder, params)
    xs = microbatches(x, n_micro)
    given = jax.tree.map(lambda a: microbatches(a, n_micro), rows)
    rows = None if not pl.replicas else pl.replicas[0] if len(pl.replicas) == 1 else pl.replicas

    def stage_program(local, xs, given):
        stage = jax.lax.axis_index(pl.axis)
        local = jax.tree.map(lambda w: w.reshape(n_repeats, per_chunk, *w.shape[1:]), local)
        # Cast what every stage (or every row) reads to varying here, once: the transpose of
        # the cast is the sum of its gradient, which would otherwise run on every tick.
        if pl.replicas:
            local = jax.tree.map(lambda w: _varying(w, pl.replicas), local)
        xs = _varying(xs, (pl.axis,))
        given = jax.tree.map(lambda a: _varying(a, (pl.axis,)), given)

        def group(ws, h, r):
            return jax.lax.scan(lambda h, w: split_aux(block(w, h, r)), h, ws)

        run = jax.checkpoint(group) if pl.remat else group
        recv = jnp.zeros_like(xs[0])
        outs = jnp.zeros_like(xs)
        ring = jnp.zeros_like(xs) if n_repeats > 1 else None
        perm = [(i, (i + 1) % n_stages) for i in range(n_stages)]

        def tick(carry, t):
            recv, outs, ring = carry
            u = t - stage
            valid = (u >= 0) & (u < n_repeats * n_micro)
            u = jnp.clip(u, 0, n_repeats * n_micro - 1)
            rep, m = u // n_micro, u % n_micro
            first = xs[m] if ring is None else jnp.where(rep == 0, xs[m], ring[m])
            h = jnp.where(stage == 0, first, recv)
            ws = jax.tree.map(lambda w: w[rep], local)
            y, aux = run(ws, h, jax.tree.map(lambda a: a[m], given))
            last = valid & (stage == n_stages - 1) & (rep == n_repeats - 1)
            # a slice, not .at[m].set: its transpose is a gather that XLA's SPMD partitioner
            # (JAX 0.12) aborts the process on where fewer rows than devices split it
            outs = jnp.where(last, jax.lax.dynamic_update_index_in_dim(outs, y, m, 0), outs)
            sent = jax.lax.ppermute(y, pl.axis, perm)
            if ring is not None:  # stage 0 keeps what comes back round for later repeats
                back = t - (n_stages - 1)
                keep = (stage == 0) & (back >= 0) & (back < (n_repeats - 1) * n_micro)
                at = jnp.clip(back, 0) % n_micro
                ring = jnp.where(keep, jax.lax.dynamic_update_index_in_dim(ring, sent, at, 0), ring)
            # this tick's aux counts toward its repeat's layers, the idle ticks' toward none
            mine = (valid & (jnp.arange(n_repeats) == rep)).astype(jnp.float32)
            aux = jax.tree.map(lambda a: mine.reshape(-1, *([1] * a.ndim)) * a[None], aux)
            return (sent, outs, ring), aux

        (_, outs, _), aux = jax.lax.scan(tick, (recv, outs, ring), jnp.arange(pl.ticks))
        # the last stage holds the outputs; every stage needs them for the layers after
        out = _from_last(jnp.where(stage == n_stages - 1, outs, jnp.zeros_like(outs)), pl.axis)
        if aux is None:
            return out, None
        aux = jax.tree.map(lambda a: a.sum(0).reshape(n_repeats * per_chunk, *a.shape[3:]), aux)
        return out, (jax.lax.psum(aux, pl.replicas) if pl.replicas else aux)

    out, aux = jax.shard_map(
        stage_program,
        in_specs=(
            jax.tree.map(lambda _: P(pl.axis), params),
            P(None, rows),
            jax.tree.map(lambda _: P(None, rows), given),
        ),
        out_specs=(P(None, rows), P(pl.axis)),
        axis_names={pl.axis, *pl.replicas},
    )(params, xs, given)
    out = joined(out, x)
    if aux is None:
        return out
    if n_repeats > 1:  # the stage axis holds the layers in the circular order: put them back
        stored = circular_order(layers, n_stages, n_repeats)
        aux = jax.tree.map(lambda a: jnp.zeros_like(a).at[stored].set(a), aux)
    return out, aux


def rows_split(x: jax.Array) -> int:
    """The devices ``x``'s rows are laid out over by its type: 1 on auto axes, where the
    compiler may lay a microbatch out otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if not is_explicit(mesh) or not x.ndim:
        return 1
    lead = jax.typeof(x).sharding.spec
    lead = lead[0] if len(lead) else None
    axes = () if lead is None else (lead,) if isinstance(lead, str) else tuple(lead)
    return math.prod(mesh.shape[a] for a in axes)


def microbatches(x: jax.Array, count: int) -> jax.Array:
    """``x`` cut into ``count`` microbatches, ``(count, rows / count, ...)``: microbatch
    ``m`` is rows ``m, m + count, ...``, so each stays spread over the batch's axes."""
    split, _ = _microbatch_shardings(x)
    shape = (x.shape[0] // count, count, *x.shape[1:])
    return jnp.reshape(x, shape, out_sharding=split).swapaxes(0, 1)


def leaf_microbatches(x: Any, count: int) -> Any:
    """A batch leaf cut into ``count`` microbatches (rows ``m, m + count, ...``)."""
    if not np.ndim(x):
        raise Unscheduled(
            "pp's schedules cut every batch leaf into microbatches along its rows; give the "
            "batch's scalars as arrays with one row each, or use -o pp.schedule=gpipe"
        )
    if x.shape[0] % count:
        raise ConfigError(
            f"{count} microbatches do not divide the batch of {x.shape[0]}: choose -o "
            f"microbatches=M with M dividing {x.shape[0]}"
        )
    return microbatches(x, count)


def joined(xs: jax.Array, like: jax.Array) -> jax.Array:
    """Microbatches (:func:`microbatches`) put back as a batch laid out like ``like``."""
    _, whole = _microbatch_shardings(like)
    return jnp.reshape(xs.swapaxes(0, 1), like.shape, out_sharding=whole)


def _microbatch_shardings(x: jax.Array) -> tuple[P | None, P | None]:
    """On explicit axes, the layouts of the batch cut into microbatches (rows over the batch's
    axes, as before) and put back; None on auto axes, where the compiler propagates them."""
    if not is_explicit(jax.sharding.get_abstract_mesh()):
        return None, None
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    return P(spec[0], None, *spec[1 : x.ndim]), P(*spec[: x.ndim])


def sums_in_float32(dtype: Any) -> bool:
    """Whether a sum of ``dtype`` inside ``shard_map`` must go in float32: on CPU a 16-bit
    float's all-reduce there aborts the process (XLA's CPU promotion pass cannot clone the
    reduction JAX writes for it)."""
    return (
        jax.default_backend() == "cpu"
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.finfo(dtype).bits < 32
    )


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` cast to varying over ``axes`` (whose transpose sums the gradient over them)."""
    if sums_in_float32(x.dtype):
        return jax.lax.pcast(x.astype(jnp.float32), axes, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, axes, to="varying")


def _from_last(x: jax.Array, axis: str) -> jax.Array:
    """The sum over ``axis`` of ``x``, which one stage alone holds (the rest zeros): exact
    in float32 too, since one term is not zero."""
    if sums_in_float32(x.dtype):
        return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
    return jax.lax.psum(x, axis)
