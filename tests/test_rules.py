"""Sharding rules by regular expression over parameter paths, for any adapter."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplug


def eqx_mlp():
    return eqx.nn.MLP(16, 4, 256, 2, key=jax.random.key(0))  # weights are (out, in)


def shardings(adapter, strategy="fsdp"):
    trainer = shardplug.Trainer(
        adapter,
        loss_fn=lambda m, b: 0.0,
        optimizer=optax.sgd(0.1),
        strategy=shardplug.get_strategy(strategy, min_size=0),
    )
    return {
        path: s.spec
        for path, s in zip(
            shardplug.core.sharding.leaf_paths(trainer.param_shardings),
            jax.tree.leaves(trainer.param_shardings),
            strict=True,
        )
    }


def test_matched_paths_get_the_rule_and_the_rest_the_size_rule():
    rules = {r"layers/[01]/weight": ("mlp", "embed"), r"layers/2/weight": (None, "mlp")}
    specs = shardings(shardplug.from_equinox(eqx_mlp(), rules=rules))
    # fsdp prefers "embed": dimension 1 of the first two weights, then "mlp" on the last
    assert specs["layers/0/weight"] == P(None, "fsdp")
    assert specs["layers/1/weight"] == P(None, "fsdp")
    assert specs["layers/2/weight"] == P(None, "fsdp")
    assert specs["layers/0/bias"] == P("fsdp")  # no rule: largest dimension that divides


def test_2d_maps_rule_names_onto_model():
    rules = {r"layers/0/weight": ("mlp", None), r"layers/1/weight": (None, "mlp")}
    specs = shardings(shardplug.from_equinox(eqx_mlp(), rules=rules), "2d")
    assert specs["layers/0/weight"] == P("model")
    assert specs["layers/1/weight"] == P(None, "model")


def test_direct_partition_specs_are_accepted():
    rules = {r"layers/1/weight": P("heads", None)}
    specs = shardings(shardplug.from_equinox(eqx_mlp(), rules=rules), "2d")
    assert specs["layers/1/weight"] == P("model")


def test_a_rule_that_matches_nothing_is_refused():
    rules = {r".*attention.*kernel": ("embed", "heads")}
    with pytest.raises(
        shardplug.RuleError,
        match=r"rule '\.\*attention\.\*kernel' matches no "
        r"parameter; paths look like layers/0/weight",
    ):
        shardings(shardplug.from_equinox(eqx_mlp(), rules=rules))


def test_two_rules_matching_one_path_are_refused():
    rules = {r"layers/.*": ("mlp",), r".*/weight": ("embed",)}
    with pytest.raises(
        shardplug.RuleError,
        match=r"parameter layers/0/weight matches two rules, "
        r"'layers/\.\*' and '\.\*/weight'",
    ):
        shardings(shardplug.from_equinox(eqx_mlp(), rules=rules))


def test_a_rule_longer_than_the_array_is_refused():
    with pytest.raises(shardplug.RuleError, match="more entries than the array has dimensions"):
        shardings(shardplug.from_equinox(eqx_mlp(), rules={r"layers/0/bias": ("mlp", "embed")}))


def test_patterns_match_whole_paths():
    with pytest.raises(shardplug.RuleError, match="matches no parameter"):
        shardings(shardplug.from_equinox(eqx_mlp(), rules={r"weight": ("mlp",)}))


def test_rules_override_nnx_annotations():
    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.layer = nnx.Linear(64, 256, kernel_init=init, rngs=rngs)

    own = shardings(shardplug.from_nnx(Net), "2d")
    assert own["layer/kernel"] == P(None, "model")
    ruled = shardings(shardplug.from_nnx(Net, rules={r"layer/kernel": ("mlp", None)}), "2d")
    assert ruled["layer/kernel"] == P("model")


def test_rules_work_for_linen():
    import flax.linen as nn

    adapter = shardplug.from_linen(
        nn.Dense(256), jnp.zeros((1, 64)), rules={r"kernel": ("mlp", None)}
    )
    assert shardings(adapter, "2d")["kernel"] == P("model")
