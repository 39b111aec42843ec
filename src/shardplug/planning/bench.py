"""Strategies side by side in one run, against the same step written by hand in plain JAX.

Every contender trains the same model on the same host batches, from the same parameters.
The rounds are interleaved (round 1 of each contender, then round 2 of each...), so a slow
moment of the machine costs every contender alike; each round times ``steps`` steps
(batches put on the devices by the loop, one wait at the end), and the figure reported is
the median over rounds.

The hand-written baseline is what a JAX user writes without shardplug: ``jax.value_and_grad``
of the loss, ``optax`` update, ``jax.jit`` with the strategy's parameter, optimizer-state and
batch shardings (``jax.shard_map`` with ``lax.pmean`` for ``pmap``; a gather constraint on the
parameters for ``fsdp``, as shardplug's fsdp has), and a loop that puts each batch on the
devices. Its losses must equal shardplug's: that is checked, so the two did the same work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.declared import Capability, declared
from shardplug.core.memory import any_off, on_host, peak_bytes
from shardplug.core.operations.layer_gather import layer_specs
from shardplug.core.registry import get_strategy, plain_strategy
from shardplug.errors import ConfigError, ShardplugError
from shardplug.loop.feed import global_struct
from shardplug.trainer import Trainer


@dataclasses.dataclass
class Result:
    """One contender's figures."""

    name: str
    strategy: str | None
    kind: str  # "shardplug", "hand-written", "nnx.jit", "one device"
    devices: int
    compile_seconds: float
    step_seconds: list[float]  # one per round
    samples_per_step: int
    tokens_per_step: int | None
    peak_bytes: int | None
    losses: list[float]

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["median_step_seconds"] = self.median_step
        out["samples_per_second"] = self.samples_per_step / self.median_step
        out["tokens_per_second"] = (
            None if self.tokens_per_step is None else self.tokens_per_step / self.median_step
        )
        del out["losses"]
        return out


#: what a strategy that any model runs under, its batch split, supports (bench's default)
_ANY_MODEL = (Capability.BATCH_SPLIT, Capability.UNEVEN_SHAPES, Capability.WITHOUT_LAYER_STACK,
              Capability.WITHOUT_SEQUENCE, Capability.WITHOUT_EXPERTS)  # fmt: skip


def default_strategies() -> list[str]:
    """Bench's default: every installed strategy with a hand-written twin that runs any
    model with its batch split (needing no layer stack, sequence or experts), as the plugins
    declare, the plainest first (today ``dp``, ``fsdp``, ``2d``, ``pmap``)."""
    from shardplug.core.registry import list_strategies

    found = []
    for info in list_strategies():
        try:
            strategy = get_strategy(info.name)
        except ShardplugError:  # one that needs options of its own: named, not defaulted
            continue
        if hand_written_form(strategy) and not set(strategy.unsupported) & set(_ANY_MODEL):
            found.append(info.name)
    plain = plain_strategy()

    def order(name: str) -> tuple:  # the plainest, parallelisms, compositions, whole ones
        composition = get_strategy(name).composition
        parts = len(composition.parts) if composition is not None else 99
        return name != plain, parts, name

    return sorted(found, key=order)


def hand_written_form(strategy: Any) -> str | None:
    """How the strategy's step is written by hand in plain JAX, as its plugin says.

    A composition of parallelisms is ``jax.jit`` with its shardings (and each parameter
    constrained where it is used, as the parallelisms' ``gather_param`` says; the operations
    they supply computed as they supply them: a ring of attention, an exchange of tokens, a
    pipeline schedule); a whole strategy names its form in a ``baseline`` attribute
    (``"jit"`` or ``"shard_map"``), or has no hand-written twin (None).
    """
    if strategy.composition is not None:
        return "jit"
    return declared(strategy.plugin, "baseline")


class _Contender:
    """Something that compiles once and then runs ``steps`` steps from host batches."""

    result: Result

    def run(self, batches: Sequence[Any], steps: int) -> float:
        raise NotImplementedError


class _Shardplug(_Contender):
    def __init__(self, name, trainer: Trainer, first: Any, samples: int, tokens: int | None):
        self.trainer = trainer
        trainer.compile(first)
        peak = peak_bytes(trainer.compiled.memory_analysis(), trainer.compiled.as_text())
        self.result = Result(
            name, name, "shardplug", int(trainer.mesh.size),
            trainer.compile_seconds, [], samples, tokens, peak, [],
        )  # fmt: skip

    def run(self, batches, steps):
        start = time.perf_counter()
        rows = self.trainer.fit(itertools.islice(itertools.cycle(batches), steps), steps)
        elapsed = time.perf_counter() - start
        self.result.losses.extend(r["loss"] for r in rows)
        return elapsed / steps


class _HandWritten(_Contender):
    """``value_and_grad``, ``optax``, ``jax.jit`` with the trainer's shardings: no shardplug."""

    def __init__(self, name, kind, template: Trainer, model, first, samples, tokens,
                 label: str | None = None):  # fmt: skip
        adapter, optimizer, mesh = template.adapter, template.optimizer, template.mesh
        params_sharding = template.state_shardings.params
        opt_sharding = template.state_shardings.opt_state
        model_state = template.state.model_state
        if jax.tree.leaves(model_state):
            raise ConfigError(
                f"the hand-written baseline covers models without model state; "
                f"{model.name!r} has batch statistics"
            )
        abstract = jax.tree.map(global_struct, first)
        # the compiled step's own layout (settled by what its attention read), else a guess
        batch_sharding = template.batch_shardings or template.strategy.shard_batch(abstract, mesh)
        strategy = label or template.strategy.name  # as bench was given it (fsdp+offload)
        form = hand_written_form(template.strategy)
        composition = template.strategy.composition
        whole = NamedSharding(mesh, P())
        key = jax.random.key(0)

        def loss(params, batch):
            # each parameter laid out where it is used, as the parallelisms' gather_param
            # say (ZeRO-3: whole); a layer stack's one layer at a time inside its loop
            per_layer = {}
            if composition is not None:
                params = composition.gather_params(params, mesh)
                per_layer = composition.layer_gathers(params, mesh)
            with layer_specs(per_layer), contextlib.ExitStack() as stack:
                # the operations the parallelisms supply (a ring of attention, an exchange
                # of tokens, a pipeline schedule), the activation rules: as they put them
                for context in template.strategy.contexts_while_tracing(mesh):
                    stack.enter_context(context)
                bound = adapter.bind(params, model_state, rng=key, train=True)
                return _loss_value(model.loss_fn(bound, batch))

        # state kept in host memory (offload): brought in where used, or updated there
        host, device = jax.memory.Space.Host, jax.memory.Space.Device
        params_off = any_off(params_sharding)
        opt_off = any_off(opt_sharding)
        host_update = opt_off and template.strategy.update_memory(template.state_shardings,
                                                                  mesh) == "host"  # fmt: skip

        def step(params, opt_state, batch):
            held = params
            if params_off:
                params = jax.device_put(params, device)
            value, grads = jax.value_and_grad(loss, allow_int=True)(params, batch)
            grads = jax.tree.map(  # a quantized frozen base's bytes: no update
                lambda g, p: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g,
                grads, params)  # fmt: skip
            if form == "shard_map":
                value, grads = jax.lax.pmean((value, grads), tuple(mesh.axis_names))
            if host_update:
                grads = jax.device_put(grads, host)
                params = held if params_off else jax.device_put(params, host)

                def update(grads, opt_state, params):
                    updates, opt_state = optimizer.update(grads, opt_state, params)
                    return optax.apply_updates(params, updates), opt_state

                params, opt_state = on_host(update, grads, opt_state, params)
                return (params if params_off else jax.device_put(params, device)), opt_state, value
            if opt_off:
                opt_state = jax.device_put(opt_state, device)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        if form == "shard_map":
            specs = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
            step = jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(specs(params_sharding), specs(opt_sharding), specs(batch_sharding)),
                out_specs=(specs(params_sharding), specs(opt_sharding), P()),
                check_vma=False,
            )
        jitted = jax.jit(
            step,
            in_shardings=(params_sharding, opt_sharding, batch_sharding),
            out_shardings=(params_sharding, opt_sharding, whole),
            donate_argnums=(0, 1),
        )
        start = time.perf_counter()
        with jax.set_mesh(mesh):  # the model's constraints name mesh axes, as in the trainer
            self.compiled = jitted.lower(
                template.state.params, template.state.opt_state, abstract
            ).compile()
        compile_seconds = time.perf_counter() - start
        # the trainer's initial parameters, copied: both start from the same point (a
        # planned trainer's are shapes: nothing to copy, nothing runs)
        if template.allocated:
            self.params = jax.tree.map(lambda x: x.copy(), template.state.params)
            self.opt_state = jax.tree.map(lambda x: x.copy(), template.state.opt_state)
        self.batch_sharding = batch_sharding
        peak = peak_bytes(self.compiled.memory_analysis(), self.compiled.as_text())
        self.result = Result(
            name, strategy, kind, int(mesh.size), compile_seconds, [], samples, tokens, peak, []
        )

    def run(self, batches, steps):
        start = time.perf_counter()
        losses = []
        for batch in itertools.islice(itertools.cycle(batches), steps):
            batch = jax.device_put(batch, self.batch_sharding)
            self.params, self.opt_state, value = self.compiled(self.params, self.opt_state, batch)
            losses.append(value)
        losses = jax.device_get(losses)
        elapsed = time.perf_counter() - start
        self.result.losses.extend(float(v) for v in losses)
        return elapsed / steps


def hand_written(trainer: Trainer, model: Any, batch: Any) -> Any:
    """The compiled program of ``trainer``'s step written by hand in plain JAX: its twin,
    from the same model, optimizer, mesh and shardings (``jax.stages.Compiled``)."""
    return _HandWritten("twin", "hand-written", trainer, model, batch, 1, None).compiled


class _NnxJit(_Contender):
    """The training loop as Flax's own documentation writes it: ``nnx.Optimizer`` and
    ``@nnx.jit``, the model replicated and the batch split over a ``data`` mesh."""

    def __init__(self, name, template: Trainer, model, first, samples, tokens):
        from flax import nnx

        mesh = jax.sharding.Mesh(np.asarray(template.mesh.devices).reshape(-1), ("data",))
        adapter = template.adapter
        params = jax.tree.map(lambda x: np.asarray(x), template.state.params)
        module = nnx.merge(adapter.graphdef, params, template.state.model_state, copy=True)
        module.train()
        replicated = NamedSharding(mesh, P())
        state = nnx.state(module)
        nnx.update(module, jax.device_put(state, replicated))
        self.optimizer = nnx.Optimizer(module, template.optimizer, wrt=nnx.Param)
        self.module = module
        self.batch_sharding = jax.tree.map(
            lambda x: NamedSharding(mesh, P("data") if np.ndim(x) else P()), first
        )
        loss_fn = model.loss_fn

        @nnx.jit
        def train_step(model, optimizer, batch):
            def loss(model):
                return _loss_value(loss_fn(model, batch))

            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        self.train_step = train_step
        start = time.perf_counter()
        jax.block_until_ready(
            # nnx.jit compiles on the first call; time it on a copy so training starts fresh
            train_step(nnx.clone(module), nnx.clone(self.optimizer), self._put(first))
        )
        compile_seconds = time.perf_counter() - start
        self.result = Result(
            name, template.strategy.info.name, "nnx.jit", int(mesh.size), compile_seconds, [],
            samples, tokens, None, []
        )

    def _put(self, batch):
        return jax.device_put(batch, self.batch_sharding)

    def run(self, batches, steps):
        start = time.perf_counter()
        losses = []
        for batch in itertools.islice(itertools.cycle(batches), steps):
            losses.append(self.train_step(self.module, self.optimizer, self._put(batch)))
        losses = jax.device_get(losses)
        elapsed = time.perf_counter() - start
        self.result.losses.extend(float(v) for v in losses)
        return elapsed / steps


def _loss_value(out: Any) -> Any:
    """The loss of a loss function that returns it alone or as ``(loss, metrics)``."""
    return out[0] if isinstance(out, tuple) else out


def bench(
    strategies: Sequence[str],
    model_name: str = "transformer",
    adapter: str = "nnx",
    devices: int | None = None,
    steps: int = 20,
    rounds: int = 5,
    batch_size: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    model_options: dict[str, Any] | None = None,
    task: Any = None,
) -> dict[str, Any]:
    """Time ``strategies`` against hand-written JAX, interleaved; see the module's docstring.

    The model is the reference ``model_name`` in ``adapter`` (with ``model_options``), or a
    :class:`shardplug.Task`'s: its adapter, loss, optimizer and first eight batches.

    :return: ``{"results": [Result.to_dict()...], "ratios": {strategy: shardplug's step time
        / hand-written's, the median of the rounds' ratios}, "nnx_jit_ratio": the same for
        shardplug's dp / the nnx.jit loop (NNX only),
        "speedup": {strategy: one device's median step / the strategy's}, "max_loss_diff":
        {strategy: largest relative difference of shardplug's losses from the baseline's}}``.
    """
    from shardplug.models import get_model

    if task is None:
        task = get_model(model_name).task(
            adapter, batch_size=batch_size, seed=seed, **(model_options or {})
        )
    _check_benchable(strategies)
    batches = _first_batches(task)
    batch_size = int(np.shape(jax.tree.leaves(batches[0])[0])[0])
    say = progress or (lambda _: None)
    contenders = _compile_contenders(task, strategies, batches, devices, steps, seed, say)
    _run_rounds(contenders, batches, steps, rounds, say)
    return {
        "model": task.name,
        "adapter": task.adapter.framework,
        "devices": int(contenders[0].result.devices),
        "platform": jax.devices()[0].platform,
        "batch_size": batch_size,
        "steps_per_round": steps,
        "rounds": rounds,
        "results": [c.result.to_dict() for c in contenders],
        **_compare(strategies, contenders),
    }


def _check_benchable(strategies: Sequence[str]) -> None:
    """Refuse an empty list, or a strategy with no hand-written twin to compare it with."""
    if not strategies:
        raise ConfigError("name at least one strategy to bench")
    unknown = [s for s in strategies if hand_written_form(get_strategy(s)) is None]
    if unknown:
        raise ConfigError(
            f"bench compares with hand-written JAX; {', '.join(unknown)} has no hand-written "
            f"twin (a whole strategy names one in its plugin's `baseline` attribute): bench "
            f"parallelisms, their compositions, or a strategy that names one"
        )


def _first_batches(task: Any) -> list[Any]:
    """The task's first eight host batches, which every contender cycles through."""
    batches = list(itertools.islice(task.batches(), 8))
    if not batches:
        raise ConfigError(f"task {task.name}: its data gave no batch")
    return batches


def _compile_contenders(
    task: Any,
    strategies: Sequence[str],
    batches: Sequence[Any],
    devices: int | None,
    steps: int,
    seed: int,
    say: Callable[[str], None],
) -> list[_Contender]:
    """Every contender, compiled: each strategy beside its hand-written twin, then Flax's
    nnx.jit loop (for dp, on an NNX module) and one device."""
    first = batches[0]
    samples = int(np.shape(jax.tree.leaves(first)[0])[0])
    tokens = int(np.size(first["tokens"])) if "tokens" in first else None

    def trainer(strategy: str, count: int | None) -> Trainer:
        return task.trainer(
            strategy=get_strategy(strategy),
            devices=count,
            seed=seed,
            log_every=steps,
            precision="float32",  # the hand-written step it is compared with computes in it
        )

    contenders: list[_Contender] = []
    trainers: dict[str, Trainer] = {}
    for strategy in strategies:
        say(f"compiling {strategy}")
        # compiling runs nothing: the baselines still copy the trainer's initial parameters
        t = trainers[strategy] = trainer(strategy, devices)
        contenders.append(_Shardplug(strategy, t, first, samples, tokens))
        name = f"{strategy} by hand"
        contenders.append(_HandWritten(name, "hand-written", t, task, first, samples, tokens,
                                       strategy))  # fmt: skip
    # Flax's own loop trains an NNX module whole: not a model wrapped in adapters (LoRA)
    plain = plain_strategy()  # data parallelism: what Flax's own loop and one device do
    nnx_module = task.adapter.framework == "nnx" and hasattr(task.adapter, "graphdef")
    if nnx_module and plain in strategies:
        say("compiling the nnx.jit loop")
        contenders.append(_NnxJit(f"{plain} as nnx.jit", trainers[plain], task, first, samples,
                                  tokens))  # fmt: skip
    say("compiling one device")
    contenders.append(
        _HandWritten("one device", "one device", trainer(plain, 1), task, first, samples, tokens)
    )
    return contenders


def _run_rounds(
    contenders: Sequence[_Contender],
    batches: Sequence[Any],
    steps: int,
    rounds: int,
    say: Callable[[str], None],
) -> None:
    """A warm-up, then ``rounds`` interleaved rounds of ``steps`` steps: each contender's
    step times in its result."""
    for contender in contenders:  # warm up: first runs pay for allocations and caches
        contender.run(batches, 2)
        contender.result.losses.clear()
    for round_ in range(rounds):
        say(f"round {round_ + 1} of {rounds}")
        # each shardplug run sits next to its baseline; every other round runs backwards,
        # so neither goes first (after the previous contender) more often
        for contender in contenders if round_ % 2 == 0 else contenders[::-1]:
            contender.result.step_seconds.append(contender.run(batches, steps))


def _paired(a: Result, b: Result) -> float:
    """The median of the rounds' ratios of ``a``'s step time to ``b``'s."""
    return statistics.median(x / y for x, y in zip(a.step_seconds, b.step_seconds, strict=True))


def _compare(strategies: Sequence[str], contenders: Sequence[_Contender]) -> dict[str, Any]:
    """The report's comparisons: ``ratios``, ``nnx_jit_ratio``, ``speedup`` and
    ``max_loss_diff`` (see :func:`bench`)."""
    by = {(c.result.kind, c.result.strategy): c.result for c in contenders}
    one = next(c.result for c in contenders if c.result.kind == "one device")
    ratios, speedup, diffs = {}, {}, {}
    for strategy in strategies:
        mine, hand = by["shardplug", strategy], by["hand-written", strategy]
        ratios[strategy] = _paired(mine, hand)
        speedup[strategy] = one.median_step / mine.median_step
        a, b = np.asarray(mine.losses), np.asarray(hand.losses)
        diffs[strategy] = float(np.max(np.abs(a - b) / np.abs(b)))
    nnx_ratio = None
    plain = plain_strategy()
    if ("nnx.jit", plain) in by:
        nnx_ratio = _paired(by["shardplug", plain], by["nnx.jit", plain])
    return {
        "ratios": ratios,
        "nnx_jit_ratio": nnx_ratio,
        "speedup": speedup,
        "max_loss_diff": diffs,
    }


__all__ = ["Result", "bench"]
