"""Each strategy puts parameters, optimizer state and the batch where it promises."""

import math

import jax
import optax
import pytest
from flax import nnx
from helpers import reference_trainer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.sharding import leaf_paths


def sharded_trainer(strategy, model_name="transformer", **kwargs):
    """A compiled trainer of a reference model (not conftest's make_trainer: this one compiles
    and returns the trainer alone)."""
    model, trainer = reference_trainer(model_name, strategy, **kwargs)
    trainer.compile(next(model.batches(model.batch_size, 0)))
    return trainer


def by_path(tree):
    return dict(zip(leaf_paths(tree), jax.tree.leaves(tree), strict=True))


def device_bytes(tree):
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def distinct_shards(array):
    return len({tuple((i.start, i.stop) for i in s.index) for s in array.addressable_shards})


def test_fsdp_holds_one_eighth_of_every_large_parameter_and_its_adam_moments():
    trainer = sharded_trainer("fsdp")
    params = by_path(trainer.state.params)
    adam = trainer.state.opt_state[0]
    for moments in (by_path(adam.mu), by_path(adam.nu)):
        assert moments.keys() == params.keys()
    large = [p for p, a in params.items() if a.size >= 1024]
    assert len(large) >= 9  # six stacked block matrices, the embeddings and the head
    for path in large:
        for array in (params[path], by_path(adam.mu)[path], by_path(adam.nu)[path]):
            assert "fsdp" in array.sharding.spec, path
            shard = array.addressable_shards[0].data
            assert math.prod(shard.shape) * 8 == array.size, path
            assert distinct_shards(array) == 8, path
    # Per device: 1/8 of every large parameter and moment, the small ones whole.
    expected = sum(a.nbytes // 8 if p in large else a.nbytes for p, a in params.items())
    for tree in (trainer.state.params, adam.mu, adam.nu):
        assert device_bytes(tree) == expected
    assert expected < 0.14 * sum(a.nbytes for a in params.values())


def test_fsdp_follows_annotations_to_the_embed_dimension():
    specs = by_path(sharded_trainer("fsdp").param_shardings)
    assert specs["blocks/wq"].spec == P(None, "fsdp")  # ("layers", "embed", "heads", "kv")
    assert specs["blocks/wo"].spec == P(None, None, None, "fsdp")  # (.., "heads", "kv", "embed")
    assert specs["blocks/wf"].spec == P(None, None, "fsdp")  # ("layers", "mlp", "embed")
    assert specs["embed"].spec == P(None, "fsdp")  # ("vocab", "embed")
    assert specs["norm/scale"].spec == P()  # 64 elements: below min_size


class Plain(nnx.Module):
    """No annotations at all; one layer whose dimensions do not divide 8."""

    def __init__(self, rngs):
        self.wide = nnx.Linear(16, 256, rngs=rngs)
        self.uneven = nnx.Linear(12, 36, rngs=rngs)


@pytest.mark.parametrize("min_size", [0, 1024])
def test_fsdp_size_rule_without_annotations(min_size):
    adapter = shardplug.from_nnx(Plain)
    assert adapter.annotations(adapter.abstract(jax.random.key(0))[0]) is None
    trainer = shardplug.Trainer(
        adapter,
        loss_fn=lambda m, b: 0.0,
        optimizer=optax.sgd(0.1),
        strategy=shardplug.get_strategy("fsdp", min_size=min_size),
    )
    specs = {p: s.spec for p, s in by_path(trainer.param_shardings).items()}
    assert specs["wide/kernel"] == P(None, "fsdp")  # the larger of 16 and 256
    assert specs["uneven/kernel"] == P()  # neither 12 nor 36 divides 8
    assert specs["wide/bias"] == (P("fsdp") if min_size == 0 else P())


def test_2d_shards_annotated_dimensions_on_model_and_replicates_over_data():
    trainer = sharded_trainer("2d", mesh="data=2,model=4")
    params = by_path(trainer.state.params)
    expected = {
        "blocks/wq": (P(None, None, "model"), (2, 64, 1, 16)),  # heads 4 / 4
        "blocks/wo": (P(None, "model"), (2, 1, 16, 64)),
        "blocks/wi": (P(None, None, "model"), (2, 64, 64)),  # mlp 256 / 4
        "blocks/wf": (P(None, "model"), (2, 64, 64)),
        "embed": (P("model"), (16, 64)),  # vocab 64 / 4
        "unembed": (P(None, "model"), (64, 16)),
        "norm/scale": (P(), (64,)),
    }
    for path, (spec, shard_shape) in expected.items():
        array = params[path]
        assert array.sharding.spec == spec, path
        assert array.addressable_shards[0].data.shape == shard_shape, path
        # Two data rows hold the same four model shards.
        assert distinct_shards(array) == array.size // math.prod(shard_shape), path
    assert trainer.batch_shardings["tokens"].spec == P("data")
    assert trainer.batch_shardings["tokens"].shard_shape((32, 32)) == (16, 32)


def test_2d_default_mesh_splits_eight_devices_into_four_by_two():
    assert dict(sharded_trainer("2d", model_name="mlp").mesh.shape) == {"data": 4, "model": 2}


@pytest.mark.parametrize("strategy", ["dp", "pmap"])
def test_replicated_strategies_hold_whole_state_on_every_device(strategy):
    trainer = sharded_trainer(strategy, model_name="mlp")
    trainer.fit(shardplug.get_model("mlp").batches(64, 0), steps=2)
    for array in jax.tree.leaves(trainer.state):
        assert isinstance(array.sharding, NamedSharding)
        assert array.sharding.is_fully_replicated
        assert array.sharding.mesh.axis_names == ("data",)
    assert trainer.batch_shardings["x"].shard_shape((64, 16)) == (8, 16)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap"])
def test_batch_is_split_not_duplicated(strategy):
    trainer = sharded_trainer(strategy, model_name="mlp")
    sharding = trainer.batch_shardings["x"]
    data_parallel = {"dp": 8, "fsdp": 8, "2d": 4, "pmap": 8}[strategy]
    assert sharding.shard_shape((64, 16)) == (64 // data_parallel, 16)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap"])
def test_state_keeps_its_shardings_through_training(strategy):
    trainer = sharded_trainer(strategy, model_name="mlp")
    before = jax.tree.map(lambda a: a.sharding, trainer.state)
    trainer.fit(shardplug.get_model("mlp").batches(64, 0), steps=3)
    after = jax.tree.map(lambda a: a.sharding, trainer.state)
    assert jax.tree.leaves(before) == jax.tree.leaves(after)
    assert jax.tree.leaves(before) == jax.tree.leaves(trainer.state_shardings)
