"""The ``offload`` add-on and the contract under it (``place_state``): the optimizer state,
and with ``params`` the parameters, kept in host memory between steps; the same training to
the last bit, the compiled step's device arguments smaller by exactly what moved, explain
counting host memory apart, checkpoints moving between runs with and without it, and bad
input in one line."""

import functools
import itertools
import math
import shutil

import jax
import numpy as np
import optax
import pytest
from helpers import said
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.cli import main
from shardplug.core import memory
from shardplug.core.sharding import to_named
from shardplug.errors import ConfigError, PluginError
from shardplug.planning.explain import explain
from shardplug.strategies.offload import Offload

STEPS = 3
# strategy, mesh, devices, options
RUNS = {
    "fsdp": ("fsdp=2", 2, {"min_size": 0}),
    "fsdp+tp": ("fsdp=2,model=2", 4, {"min_size": 0}),
    "pp": ("stage=2", 2, {"schedule": "zb"}),
}


@functools.cache
def task():
    return shardplug.get_model("transformer").task("nnx", layers=2)


@functools.cache
def batches():
    return tuple(itertools.islice(task().batches(), 2 * STEPS))


def trainer(strategy="fsdp", offload=None, **kwargs):
    mesh, devices, options = RUNS[strategy]
    extra = {f"offload.{k}": v for k, v in (offload or {}).items()}
    made = shardplug.get_strategy(strategy, addons=["offload"] if offload is not None else [],
                                  **options, **extra)  # fmt: skip
    return task().trainer(strategy=made, mesh=mesh, devices=devices, precision="float32",
                          **kwargs)  # fmt: skip


@functools.cache
def losses(strategy, offload=None):
    run = trainer(strategy, None if offload is None else dict(offload))
    run.fit(iter(batches()[:STEPS]), STEPS)
    kinds = {
        part: {x.sharding.memory_kind for x in jax.tree.leaves(getattr(run.state, part))}
        for part in ("params", "opt_state")
    }
    return [r["loss"] for r in run.history], kinds


def shard_bytes(tree, shardings):
    return sum(
        math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


@pytest.mark.parametrize("strategy", RUNS)
def test_offload_trains_as_without_it_the_state_in_host_memory(strategy):
    want, kinds = losses(strategy)
    got, moved = losses(strategy, ())
    assert got == want  # the same arithmetic, to the last bit
    assert kinds == {"params": {"device"}, "opt_state": {"device"}}
    assert moved == {"params": {"device"}, "opt_state": {"pinned_host"}}


@pytest.mark.parametrize("params", [False, True])
def test_an_update_on_the_host_trains_as_on_the_devices(params):
    want, _ = losses("fsdp")
    got, moved = losses("fsdp", (("params", params), ("update", "host")))
    assert got == want
    assert moved == {
        "params": {"pinned_host" if params else "device"},
        "opt_state": {"pinned_host"},
    }


def test_offloaded_parameters_train_as_on_the_devices():
    want, _ = losses("fsdp")
    got, moved = losses("fsdp", (("params", True),))
    assert got == want
    assert moved == {"params": {"pinned_host"}, "opt_state": {"pinned_host"}}
    only, moved = losses("fsdp", (("params", True), ("opt_state", False)))
    assert only == want
    assert moved == {"params": {"pinned_host"}, "opt_state": {"device"}}


def test_the_compiled_step_holds_on_the_devices_exactly_what_did_not_move():
    """Read from the compiled program's entry layout: the device arguments shrink by the
    optimizer state's bytes per device (and the parameters' with ``params``), which the
    host now holds; explain's device peak drops by as much, and says what the host holds."""
    batch = batches()[0]
    got = {}
    for name, offload in (("none", None), ("opt", {}), ("both", {"params": True})):
        run = trainer("fsdp", offload, allocate=False)
        report = explain(run, batch)
        with_both_notes = report.notes
        args = memory.argument_bytes(run.compiled.as_text())
        got[name] = (args, report.per_device)
        shardings = run.state_shardings
    opt = shard_bytes(run.state.opt_state, shardings.opt_state)
    params = shard_bytes(run.state.params, shardings.params)
    (none, plain), (opt_args, with_opt), (both_args, with_both) = got.values()
    assert none["host"] == 0 and opt_args["host"] == opt and both_args["host"] == opt + params
    assert none["device"] - opt_args["device"] == opt
    assert none["device"] - both_args["device"] == opt + params
    assert with_opt["host_bytes"] == opt == with_opt["opt_state_bytes"] and plain["host_bytes"] == 0
    assert plain["peak_bytes"] - with_opt["peak_bytes"] == opt
    # explain's device arguments drop by what moved too, and offload moves no activation
    assert plain["argument_bytes"] - with_opt["argument_bytes"] == opt
    assert plain["argument_bytes"] - with_both["argument_bytes"] == opt + params
    assert not any("moves activations" in note for note in with_both_notes)
    assert plain["peak_bytes"] - with_both["peak_bytes"] == opt + params
    # copied in for the update a parameter's Adam moments at a time (XLA:CPU counts no
    # copy: said in a note), or updated there
    largest = max(
        shard_bytes(x, s)
        for x, s in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(shardings.params),
                        strict=True)
    )  # fmt: skip
    assert with_opt["update_bytes"] == 2 * largest + 4 and plain["update_bytes"] == 0
    on_host = explain(trainer("fsdp", {"update": "host"}, allocate=False), batch).per_device
    assert on_host["update_bytes"] == 0 and on_host["peak_bytes"] == with_opt["peak_bytes"]


HOST_UPDATE = pytest.param({"params": True, "update": "host"}, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "mode", [{}, {"params": True}, HOST_UPDATE], ids=["state", "params", "params-update-host"]
)
def test_checkpoints_move_between_runs_with_and_without_offload(tmp_path, mode):
    """Saved under each offload mode and resumed without it, and the other way: the same
    losses as one run (a save with the parameters on the host crashed judging them finite)."""
    full = trainer("fsdp")
    full.fit(iter(batches()), 2 * STEPS)
    rest = [r["loss"] for r in full.history][STEPS:]
    for first, then in ((True, False), (False, True)):
        saved = tmp_path / f"{first}"
        start = trainer("fsdp", mode if first else None, checkpoint_dir=saved)
        start.fit(iter(batches()[:STEPS]), STEPS)
        del start
        shutil.copytree(saved, tmp_path / f"{first}-resumed")
        resumed = trainer(
            "fsdp", mode if then else None, checkpoint_dir=tmp_path / f"{first}-resumed"
        )
        assert resumed.restore() == STEPS
        for part, moves in (("opt_state", True), ("params", "params" in mode)):
            kind = {x.sharding.memory_kind for x in jax.tree.leaves(getattr(resumed.state, part))}
            assert kind == {"pinned_host" if then and moves else "device"}, part
        resumed.fit(iter(batches()[STEPS:]), STEPS)  # and saves its last step
        np.testing.assert_allclose([r["loss"] for r in resumed.history], rest, rtol=1e-6)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-o", "offload.params=maybe"], "option params='maybe' is not a valid bool"),
        (["-o", "offload.bogus=1"], "add-on 'offload' has no option 'bogus'; its options: "
                                    "opt_state, params, update"),
        (["-o", "offload.update=gpu"], "offload option update must be device (the optimizer "
                                       "state copied in for the update) or host (the update "
                                       "computed on the host), got 'gpu'"),
        (["-o", "offload.update=host", "-o", "offload.opt_state=false", "-o",
          "offload.params=true"], "offload's update=host computes the update next to the "
                                  "optimizer state in host memory: keep opt_state=true"),
        (["-o", "offload.opt_state=false"], "offload with opt_state=false and params=false "
                                            "moves nothing: leave the add-on out, or "
                                            "offload one of them"),
    ],
)  # fmt: skip
def test_bad_offload_options_are_one_line(capsys, flags, message):
    assert main(["train", "--strategy", "fsdp", "--addon", "offload", *flags, "--steps", "1"]) == 2
    assert said(capsys.readouterr().err) == [f"shardplug: error: {message}"]


def test_an_addons_option_without_the_addon_says_to_add_it(capsys):
    assert main(["train", "--strategy", "fsdp", "-o", "offload.params=true", "--steps", "1"]) == 2
    err = said(capsys.readouterr().err)
    assert err == [
        "shardplug: error: strategy 'fsdp' has no option 'offload.params' (an option "
        "of the add-on 'offload': add --addon offload); its options: min_size, prefer"
    ]


def test_a_per_device_program_refuses_offload():
    with pytest.raises(
        ConfigError,
        match="a per-device program takes its state on the devices: it cannot keep arrays in "
        "host memory",
    ):
        trainer_pmap = task().trainer(
            strategy=shardplug.get_strategy("pmap", addons=["offload"]), devices=2,
            precision="float32", allocate=False,
        )  # fmt: skip
        trainer_pmap.compile(batches()[0])


def test_a_placement_that_is_not_one_is_refused_in_one_line():
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip
    laid = {"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P())}
    assert memory.checked(jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), laid),
                          laid, "strategy 'x'")["w"].memory_kind == "pinned_host"  # fmt: skip
    with pytest.raises(PluginError, match="place_state returned a tree of 1 leaves where the "
                                          "state has 2"):  # fmt: skip
        memory.checked({"w": laid["w"]}, laid, "strategy 'x'")
    changed = r"place_state changed how w is split \(P\('fsdp',\) to P\(\)\): it chooses the memory"
    with pytest.raises(PluginError, match=changed):
        memory.checked({**laid, "w": laid["b"]}, laid, "strategy 'x'")


def test_an_addon_given_as_an_object_is_checked():
    class Axis:
        @shardplug.plugin.hookimpl
        def parallel_axis(self):
            return shardplug.plugin.Axis("x", rank=1)

    with pytest.raises(PluginError, match=r"add-on 'Offload': give an instance \(Offload\(\)\)"):
        shardplug.get_strategy("fsdp", addons=[Offload])
    with pytest.raises(PluginError, match="add-on 'Axis' declares parallel_axis"):
        shardplug.get_strategy("fsdp", addons=[Axis()])
    made = shardplug.get_strategy("fsdp", addons=[Offload(update="host")])
    assert made.addons == ("Offload",)


def test_a_memory_kind_a_layout_hook_returns_is_kept_or_refused():
    """A ``NamedSharding`` with a memory kind from ``shard_params`` keeps it (the optimizer
    state follows it); from ``shard_batch`` it is refused: a step reads its batch on the
    devices."""
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip
    like = {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}
    given = {"w": NamedSharding(mesh, P("fsdp"), memory_kind="pinned_host")}
    kept = to_named(given, mesh, plugin="x", hook="shard_params", like=like)
    assert kept["w"].memory_kind == "pinned_host" and kept["w"].spec == P("fsdp")
    refused = "strategy 'x': shard_batch put w in memory 'pinned_host', where a step cannot"
    with pytest.raises(PluginError, match=refused):
        to_named(given, mesh, plugin="x", hook="shard_batch", like=like)


def test_the_cli_trains_with_offload(capsys):
    assert main(["train", "--strategy", "fsdp", "--devices", "2", "--addon", "offload",
                 "--layers", "2", "--steps", "2"]) == 0  # fmt: skip
    assert "with fsdp + offload on 2 cpu devices" in capsys.readouterr().out


def test_bench_times_offload_against_its_hand_written_twin():
    """``bench --strategies fsdp+offload``: an add-on named in the composition, its twin in
    plain JAX (memory kinds in the shardings, ``device_put`` where the state is used), the
    same losses."""
    from shardplug.planning.bench import bench

    report = bench(["fsdp+offload"], devices=2, steps=2, rounds=1, model_options={"layers": 2})
    assert report["max_loss_diff"] == {"fsdp+offload": 0.0}
    mine = next(r for r in report["results"] if r["kind"] == "shardplug")
    assert mine["strategy"] == "fsdp+offload"


def test_recommend_offloads_where_nothing_else_fits(capsys):
    """Memory a byte below the lower of dp's and fsdp's peaks: neither fits on the devices
    alone, and one with its optimizer state on the host does (which, the compiler's figures
    say: dp's peak is below fsdp's on JAX 0.12, above it on 0.10)."""
    import json

    plan = ["recommend", "--model", "transformer", "--layers", "2", "--devices", "2",
            "--strategies", "dp,fsdp", "--json", "--device-memory"]  # fmt: skip
    assert main([*plan, "80GB"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    memory = min(r["peak_bytes"] for r in rows.values()) - 1
    could = {f"{n}+offload" for n, r in rows.items()
             if r["peak_bytes"] - r["opt_state_bytes"] <= memory}  # fmt: skip
    assert could
    assert main([*plan, str(memory)]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["recommended"] in could
    assert tight["options"] == {"offload.update": "host"}
    assert tight["reason"].startswith(
        "nothing fits on the devices alone (dp, fsdp do not); "
        "with offload, the optimizer state in host memory"
    )


# -- the update in pieces ---------------------------------------------------------------------

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw with a schedule": lambda: optax.adamw(
        optax.cosine_decay_schedule(1e-2, 100), weight_decay=0.1
    ),
    "sgd with momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
}


def _pieces_program(optimizer):
    keys = iter(jax.random.split(jax.random.key(0), 6))
    shapes = {"a": (4, 3), "b": (3,), "c": {"d": (2, 2)}}
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))  # fmt: skip
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
    state = optimizer.init(params)
    for _ in range(2):  # a state that is not zeros
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, grads, state


@pytest.mark.parametrize(
    ("name", "away"), [(name, False) for name in OPTIMIZERS] + [("adam", True)]
)
def test_the_update_brings_one_parameters_state_at_a_time_and_computes_the_same(name, away):
    """Each parameter's optimizer state (and the parameter, ``away``: kept on the host too)
    comes to the devices only once its gradient exists and the previous parameter's new
    state has left for the host (a barrier, in the program's data flow), and the update is
    the whole tree's, bit for bit."""
    optimizer = OPTIMIZERS[name]()
    params, grads, state = _pieces_program(optimizer)
    labels = memory.leafwise(optimizer, grads, state, params)
    assert labels is not None and set(labels) - {-1} == {0, 1, 2}
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])  # fmt: skip
    device = NamedSharding(mesh, P())
    host = device.with_memory_kind("pinned_host")
    held = jax.device_put(state, jax.tree.map(lambda _: host, state))
    where = host if away else device
    given = jax.device_put(params, jax.tree.map(lambda _: where, params))

    def pieces(p, s, g):
        off = jax.tree.map(lambda _: away, p)
        return memory.update_in_pieces(optimizer, g, p, s, labels, None, off)

    def whole(p, s, g):
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    got = jax.jit(pieces, out_shardings=(jax.tree.map(lambda _: where, params),
                                         jax.tree.map(lambda _: host, state)))(
        given, held, grads)  # fmt: skip
    want = jax.jit(whole)(params, state, grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    eqns = jax.make_jaxpr(pieces)(given, held, grads).jaxpr.eqns
    made_by = {out: e for e in eqns for out in e.outvars}

    def to(e, space):
        return e.primitive.name == "device_put" and space in str(e.params["devices"])

    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 3  # one a parameter
    gradients = set(jax.make_jaxpr(pieces)(given, held, grads).jaxpr.invars[-3:])
    for k, barrier in enumerate(barriers):
        inputs = [made_by.get(v) for v in barrier.invars if type(v).__name__ != "Literal"]
        # its own gradient: nothing comes before the gradient it updates with exists
        assert len(gradients & set(barrier.invars)) == 1
        # and from the second on, the last one's new state, sent
        assert any(e is not None and to(e, "Host") for e in inputs) == (k > 0)
        fed = [e for e in eqns if any(v in barrier.outvars for v in e.invars
                                      if type(v).__name__ != "Literal")]  # fmt: skip
        assert fed and all(to(e, "Device") for e in fed)  # the next one's, brought


def test_a_global_norm_clip_couples_the_parameters_and_brings_the_state_whole():
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    params, grads, state = _pieces_program(clipped)
    assert memory.leafwise(clipped, grads, state, params) is None
    model = shardplug.get_model("transformer")

    def run(addons):
        made = shardplug.get_strategy("fsdp", addons=addons, min_size=0)
        task = shardplug.Task(model.adapter("nnx", layers=2), model.loss_fn, clipped, data=())
        trainer = task.trainer(strategy=made, devices=2, precision="float32")
        return [r["loss"] for r in trainer.fit(iter(batches()[:STEPS]), STEPS)]

    np.testing.assert_allclose(run(["offload"]), run([]), rtol=1e-6)


@pytest.mark.parametrize("offload", [{}, {"update": "host"}, {"params": True}])
def test_a_step_that_judges_itself_skips_alike_with_offload(offload):
    """``on_nonfinite="skip"`` with a step whose gradient is not finite: the state kept on
    the host is kept as it was, as on the devices."""
    import jax.numpy as jnp

    def poisoned(model, batch):  # the steps after the first: an infinite loss
        loss, *rest = model_loss(model, batch)
        loss = jnp.where(batch["tokens"][0, 0] == first, loss, jnp.inf * loss)
        return (loss, *rest)

    model = shardplug.get_model("transformer")
    model_loss = model.loss_fn
    first = int(batches()[0]["tokens"][0, 0])

    def run(addons, extra):
        made = shardplug.get_strategy("fsdp", addons=addons, min_size=0, **extra)
        task = shardplug.Task(model.adapter("nnx", layers=2), poisoned, optax.adam(1e-2), data=())
        trainer = task.trainer(strategy=made, devices=2, precision="float32",
                               on_nonfinite="skip")  # fmt: skip
        rows = trainer.fit(iter(batches()[:STEPS]), STEPS)
        return [r["loss"] for r in rows], [r.get("skipped", 0) for r in rows]

    want = run([], {})
    got = run(["offload"], {f"offload.{k}": v for k, v in offload.items()})
    assert got == want and any(want[1])


def test_what_undoes_or_cannot_take_offload_is_refused_in_one_line():
    """A step program that takes the state in device memory (undoing offload every step), a
    per-device program with the update on the host, an add-on named twice, the update on
    the host with some optimizer state on the devices, the step count on the host."""

    class DeviceJit:
        @shardplug.plugin.hookimpl
        def compile_step(self, step_fn, state_shardings, batch_shardings):
            on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), state_shardings)
            return jax.jit(step_fn, in_shardings=(on_device, batch_shardings),
                           out_shardings=(on_device, None))  # fmt: skip

    undone = task().trainer(strategy=shardplug.get_strategy("fsdp", addons=[Offload(),
                                                                          DeviceJit()]),
                            devices=2, precision="float32", allocate=False)  # fmt: skip
    with pytest.raises(PluginError, match=r"compile_step's program takes the state's "
                                          r"opt_state/\S+ in memory 'device', and place_state "
                                          r"keeps it in 'pinned_host'"):  # fmt: skip
        undone.compile(batches()[0])
    pmapped = task().trainer(strategy=shardplug.get_strategy("pmap", addons=[Offload(
        update="host")]), devices=2, precision="float32", allocate=False)  # fmt: skip
    with pytest.raises(ConfigError, match="a per-device program takes its state on the "):
        pmapped.compile(batches()[0])
    with pytest.raises(shardplug.CompositionError, match="add-on 'offload' is given twice"):
        shardplug.get_strategy("fsdp+offload", addons=["offload"])

    class Half:
        @shardplug.plugin.hookimpl
        def place_state(self, shardings):
            leaves, tree = jax.tree.flatten(shardings.opt_state)
            half = [s.with_memory_kind("pinned_host") if i % 2 else s for i, s in enumerate(leaves)]
            return shardings._replace(opt_state=jax.tree.unflatten(tree, half))

        @shardplug.plugin.hookimpl
        def update_memory(self):
            return "host"

    with pytest.raises(PluginError, match="some of the optimizer state lives on the devices"):
        task().trainer(strategy=shardplug.get_strategy("fsdp", addons=[Half()]), devices=2,
                       precision="float32", allocate=False).compile(batches()[0])  # fmt: skip

    class Everything:
        @shardplug.plugin.hookimpl
        def place_state(self, shardings):
            return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)

    with pytest.raises(PluginError, match="place_state put the state's step in host memory"):
        task().trainer(strategy=shardplug.get_strategy("fsdp", addons=[Everything()]),
                       devices=2, precision="float32", allocate=False)  # fmt: skip


def test_the_conformance_suite_runs_offload_beside_an_add_on_packages_own():
    """A conformance class whose options name its own add-on (an add-on package's) runs the
    offload check with both (``got multiple values for keyword argument 'addons'``)."""
    from shardplug.testing import StrategyConformance

    class WithAddon(StrategyConformance):
        strategy = "fsdp"
        mesh = "fsdp=2"
        devices = 2
        options = {"addons": ["grad-bf16"]}  # noqa: RUF012 (a class attribute the suite reads)

    WithAddon().test_keeps_the_state_where_offload_places_it()
