"""Expert parallelism: the experts split over `expert`, tokens sent to them by all-to-all;
every composition trains like one device, dropless or dropping for capacity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplug
from shardplug import moe
from shardplug.core.compiled.hlo import collectives
from shardplug.core.sharding import leaf_paths
from shardplug.testing.conformance import _losses, one_device_losses

STEPS = 3
MOE = {"experts": 4, "top_k": 2}


@pytest.mark.parametrize(
    ("name", "mesh", "adapter", "options"),
    [
        # inside pp's schedule each layer's tally adds up over the microbatches
        ("pp+ep", "stage=2,expert=4", "linen", {**MOE, "bias_rate": 0.05}),
        # capacity in 8 groups (each device's own): slots of exactly the assignments' bytes
        (
            "dp+ep",
            "data=2,expert=4",
            "equinox",
            {"experts": 8, "top_k": 2, "capacity_factor": 1.0, "capacity_groups": 8},
        ),
        # in 2 groups of two devices each: a device's place follows its group's earlier one;
        # the axis renamed (axis_names={"expert": "ex"})
        ("ep", "ex=4", "nnx", {**MOE, "capacity_factor": 0.75, "capacity_groups": 2}),
        # no ep: each device routes its own rows, capacity counted over all of them
        ("dp", "data=8", "nnx", {**MOE, "capacity_factor": 0.75}),
    ],
)
def test_compositions_with_ep_train_like_one_device(name, mesh, adapter, options):
    devices = 8 if "data" in mesh or "stage" in mesh else 4
    renamed = {"axis_names": {"expert": "ex"}} if "ex=" in mesh else {}
    if name.startswith("pp"):  # GPipe's: its state updated from the whole batch's tallies
        renamed["schedule"] = "gpipe"
    losses = _losses(name, renamed, adapter, "transformer", STEPS, 0, devices, mesh, options)
    want = one_device_losses(adapter, "transformer", STEPS, 0, tuple(sorted(options.items())))
    np.testing.assert_allclose(losses, want, rtol=1e-4)


def _ep_trainer(**options):
    model = shardplug.get_model("transformer")
    task = model.task("nnx", **{**MOE, **options})
    return model, task.trainer(strategy="ep", mesh="expert=4", devices=4)


def test_each_device_holds_a_quarter_of_the_experts_and_their_adam_state():
    """allocate=False: the layouts alone. The experts' weights and both Adam moments are
    split four ways on their expert dimension; everything else is whole, as under dp."""
    _, trainer = _ep_trainer()
    state = trainer.state_shardings
    for tree in (state.params, state.opt_state):
        for path, sharding in zip(leaf_paths(tree), jax.tree.leaves(tree), strict=True):
            if "experts_" in path:
                assert sharding.spec == jax.sharding.PartitionSpec(None, "expert"), path
    params = trainer.state.params
    by_path = dict(zip(leaf_paths(params), jax.tree.leaves(params), strict=True))
    experts_in = by_path["blocks/experts_in"]
    sharding = dict(zip(leaf_paths(state.params), jax.tree.leaves(state.params), strict=True))
    local = sharding["blocks/experts_in"].shard_shape(experts_in.shape)
    assert local == (2, 1, 64, 256) and experts_in.shape == (2, 4, 64, 256)


def test_the_step_exchanges_tokens_by_all_to_all():
    """ep (expert=4), 2 layers of 4 experts, top-2, 1024 tokens: each device's 512
    assignments go out in one slot per device (dropless: 512 rows each, any could go to one
    device), come back, and so do their gradients: 2 layers x 4 exchanges x 4 slots x 512
    rows x 64 wide x 4 bytes; the experts' ids go out once per layer (int32)."""
    model, trainer = _ep_trainer()
    trainer.compile(next(model.batches(model.batch_size, 0)))
    found = {(c.kind, c.dtype): c for c in collectives(trainer.compiled.as_text())}
    assert found["all-to-all", "f32"].bytes == 2 * 4 * 4 * 512 * 64 * 4
    assert found["all-to-all", "f32"].count == 2 * 4
    assert found["all-to-all", "s32"].bytes == 2 * 4 * 512 * 4
    _, dropping = _ep_trainer(capacity_factor=0.25)  # 128 assignments an expert: 128 a slot
    dropping.compile(next(model.batches(model.batch_size, 0)))
    found = {(c.kind, c.dtype): c for c in collectives(dropping.compiled.as_text())}
    assert found["all-to-all", "f32"].bytes == 2 * 4 * 4 * 128 * 64 * 4
    # capacity counted on each device's own tokens: a slot is its even share, 512 / 4 rows
    # at F = 1, the textbook's tokens x top-k x width x 4 bytes (each exchange 512 x 64 x 4)
    _, textbook = _ep_trainer(capacity_factor=1.0, capacity_groups=4)
    textbook.compile(next(model.batches(model.batch_size, 0)))
    found = {(c.kind, c.dtype): c for c in collectives(textbook.compiled.as_text())}
    assert found["all-to-all", "f32"].bytes == 2 * 4 * 512 * 64 * 4


def test_the_routing_bias_is_state_each_steps_load_moves():
    """Auxiliary-loss-free balancing: the bias is model state (no parameter, no Adam state);
    a step moves each layer's bias by the rate toward even load, from the load it routed."""
    model, trainer = _ep_trainer(bias_rate=0.05)
    batch = next(model.batches(model.batch_size, 0))
    assert not any("router_bias" in p for p in leaf_paths(trainer.state.params))
    before = trainer.state
    module = trainer.adapter.bind(
        before.params, before.model_state, rng=jax.random.key(0), train=False
    )
    _, tallies, bias = module(batch["tokens"])  # evaluation: the bias stays
    assert float(jnp.abs(bias).max()) == 0.0
    want = moe.balance_bias(bias, tallies.kept, 0.05)
    (row,) = trainer.fit(iter([batch]), steps=1)
    (got,) = jax.tree.leaves(trainer.state.model_state)
    np.testing.assert_allclose(got, want)
    assert set(np.unique(np.asarray(got)).tolist()) <= {np.float32(x) for x in (-0.05, 0, 0.05)}
    assert float(jnp.abs(got).max()) > 0 and row["router_bias"] == 0
    (row,) = trainer.fit(iter([batch]), steps=1)
    assert row["router_bias"] > 0  # the second step routed by the moved bias


def test_ep_with_tensor_parallelism_on_explicit_axes_trains_like_one_device():
    """An explicit-mode mixture (shardplug.testing.explicit.ExpertNet) under ep+tp: the
    exchange is one per-device program over every axis (XLA refuses one nested in another)."""
    from shardplug.testing.conformance import _explicit_losses, _explicit_one_device

    got = _explicit_losses("ep+tp", 8, "expert=4,model=2", 5, 0, experts=True)
    np.testing.assert_allclose(got, _explicit_one_device(5, 0, True), rtol=1e-5)


def test_explain_reduces_the_experts_over_data_only_and_never_gathers_them():
    """dp+ep: the experts stay split where they are used, so the textbook has no all-gather
    or reduce-scatter, only the gradients' all-reduce over data (the experts' too: each is
    held by two data replicas); the compiled all-reduces are that plus the rows' statistics."""
    from shardplug.planning.explain import explain

    model = shardplug.get_model("transformer")
    trainer = model.task("nnx", **MOE).trainer(
        strategy="dp+ep", mesh="data=2,expert=4", devices=8, allocate=False
    )
    report = explain(trainer, next(model.batches(model.batch_size, 0)))
    assert {t["kind"] for t in report.textbook} == {"all-reduce"}
    compiled = sum(c["bytes"] for c in report.collectives if c["kind"] == "all-reduce")
    assert 0 <= compiled - report.textbook_bytes("all-reduce") <= 256


def test_without_ep_each_device_sorts_only_its_own_rows():
    """dp over 8 devices: the mixture is a per-device program over the batch axes, so the
    step's all-gathers (the capacity counts, the router's probabilities) move less than one
    copy of the batch's rows (1024 x 64 x 4 B); sorting across devices moved several."""
    model = shardplug.get_model("transformer")
    task = model.task("nnx", **MOE, capacity_factor=0.75)
    trainer = task.trainer(strategy="dp", devices=8, allocate=False)
    trainer.compile(next(model.batches(model.batch_size, 0)))
    found = collectives(trainer.compiled.as_text())
    assert sum(c.bytes for c in found if c.kind == "all-gather") < 1024 * 64 * 4
    assert not any(c.kind == "all-to-all" for c in found)


def test_rows_carry_the_expert_load_and_the_dropped_share():
    model, trainer = _ep_trainer(capacity_factor=0.75)
    (row,) = trainer.fit(model.batches(model.batch_size, 0), steps=1)
    assert 1.0 <= row["expert_load"] <= 4.0 and 0.0 < row["dropped"] < 1.0
    assert row["moe_balance_loss"] >= 1.0 - 1e-6 and row["moe_z_loss"] > 0


def test_bad_expert_input_is_one_line(capsys):
    from shardplug.cli import main

    model = shardplug.get_model("transformer")
    task = model.task("nnx", experts=6, top_k=2)
    with pytest.raises(shardplug.ConfigError, match="6 experts do not split over the 4 devices"):
        task.trainer(strategy="ep", mesh="expert=4", devices=4)
    with pytest.raises(shardplug.ConfigError, match="and this model has none: give it experts"):
        model.task("nnx").trainer(strategy="ep", mesh="expert=4", devices=4)
    dropping = model.task("nnx", **MOE, capacity_factor=1.0)
    pipelined = dropping.trainer(strategy="pp+ep", mesh="stage=2,expert=4")
    with pytest.raises(shardplug.ConfigError, match="would count capacity in each microbatch"):
        pipelined.compile(next(model.batches(model.batch_size, 0)))
    assert main(["train", "--experts", "2", "--top-k", "3", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "top_k 3 is more than the 2 experts" in err and err.count("\n") == 1
    grouped = ["--capacity-factor", "1", "--capacity-groups", "3", "--steps", "1"]
    assert main(["train", "--experts", "4", *grouped]) == 2
    err = capsys.readouterr().err
    assert "capacity_groups=3 must divide the 1024 tokens" in err and err.count("\n") == 1
    ep = ["--strategy", "ep", "--mesh", "expert=4", "--devices", "4", "--sequence", "24"]
    assert main(["train", "--experts", "4", *grouped, *ep]) == 2  # 768 tokens: 3 groups
    err = capsys.readouterr().err
    assert "capacity_groups=3 and the batch's 4 devices" in err and err.count("\n") == 1
