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
import pytest
from helpers import said
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.cli import main
from shardplug.core import memory
from shardplug.core.sharding import to_named
from shardplug.errors import ConfigError, PluginError
from shardplug.explain import explain
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
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert kinds == {"params": {"device"}, "opt_state": {"device"}}
    assert moved == {"params": {"device"}, "opt_state": {"pinned_host"}}


@pytest.mark.parametrize("params", [False, True])
def test_an_update_on_the_host_trains_as_on_the_devices(params):
    want, _ = losses("fsdp")
    got, moved = losses("fsdp", (("params", params), ("update", "host")))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert moved == {
        "params": {"pinned_host" if params else "device"},
        "opt_state": {"pinned_host"},
    }


def test_offloaded_parameters_train_as_on_the_devices():
    want, _ = losses("fsdp")
    got, moved = losses("fsdp", (("params", True),))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert moved == {"params": {"pinned_host"}, "opt_state": {"pinned_host"}}
    only, moved = losses("fsdp", (("params", True), ("opt_state", False)))
    np.testing.assert_allclose(only, want, rtol=1e-6)
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
    assert plain["peak_bytes"] - with_both["peak_bytes"] == opt + params
    # copied in for the update (XLA:CPU counts no copy: said in a note), or updated there
    assert with_opt["update_bytes"] == opt and plain["update_bytes"] == 0
    on_host = explain(trainer("fsdp", {"update": "host"}, allocate=False), batch).per_device
    assert on_host["update_bytes"] == 0 and on_host["peak_bytes"] == with_opt["peak_bytes"]


def test_checkpoints_move_between_runs_with_and_without_offload(tmp_path):
    full = trainer("fsdp")
    full.fit(iter(batches()), 2 * STEPS)
    rest = [r["loss"] for r in full.history][STEPS:]
    for first, then in ((True, False), (False, True)):
        saved = tmp_path / f"{first}"
        start = trainer("fsdp", {} if first else None, checkpoint_dir=saved)
        start.fit(iter(batches()[:STEPS]), STEPS)
        del start
        shutil.copytree(saved, tmp_path / f"{first}-resumed")
        resumed = trainer(
            "fsdp", {} if then else None, checkpoint_dir=tmp_path / f"{first}-resumed"
        )
        assert resumed.restore() == STEPS
        kind = {x.sharding.memory_kind for x in jax.tree.leaves(resumed.state.opt_state)}
        assert kind == {"pinned_host" if then else "device"}
        resumed.fit(iter(batches()[STEPS:]), STEPS)
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
    from shardplug.bench import bench

    report = bench(["fsdp+offload"], devices=2, steps=2, rounds=1, model_options={"layers": 2})
    assert report["max_loss_diff"] == {"fsdp+offload": 0.0}
    mine = next(r for r in report["results"] if r["kind"] == "shardplug")
    assert mine["strategy"] == "fsdp+offload"


def test_recommend_offloads_where_nothing_else_fits(capsys):
    """Memory between fsdp's peak and that peak less its optimizer state: neither dp nor
    fsdp fits on the devices alone, fsdp with the optimizer state on the host does."""
    import json

    plan = ["recommend", "--model", "transformer", "--layers", "2", "--devices", "2",
            "--strategies", "dp,fsdp", "--json", "--device-memory"]  # fmt: skip
    assert main([*plan, "80GB"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    fsdp = rows["fsdp"]
    memory = fsdp["peak_bytes"] - fsdp["opt_state_bytes"] // 2
    assert main([*plan, str(memory)]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["recommended"] == "fsdp+offload"
    assert tight["options"] == {"offload.update": "host"}
    assert tight["reason"].startswith(
        "nothing fits on the devices alone (dp, fsdp do not); "
        "with offload, the optimizer state in host memory"
    )
