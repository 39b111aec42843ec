"""Each strategy's compiled step communicates as the strategy promises (read from the HLO)."""

import collections
import re

import jax
import optax
import pytest

import shardplug

KINDS = "all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"


def collectives(strategy, model_name="transformer"):
    model = shardplug.get_model(model_name)
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3), strategy=strategy
    )
    trainer.compile(next(model.batches(model.batch_size, 0)))
    hlo = trainer.compiled.as_text()
    return trainer, collections.Counter(re.findall(rf"\s({KINDS})(?:-start)?\(", hlo))


@pytest.mark.parametrize("strategy", ["dp", "pmap"])
def test_data_parallel_only_all_reduces(strategy):
    _, found = collectives(strategy)
    assert set(found) == {"all-reduce"}


def test_fsdp_gathers_each_sharded_parameter_once_and_moves_no_activations():
    trainer, found = collectives("fsdp")
    sharded = [s for s in jax.tree.leaves(trainer.param_shardings) if not s.is_fully_replicated]
    assert found["all-gather"] == len(sharded) == 15
    assert found["all-to-all"] == 0 and found["collective-permute"] == 0
    # the gradients: one reduction (an all-reduce feeding each shard's slice on CPU,
    # a reduce-scatter where the backend has one)
    assert found["all-reduce"] + found["reduce-scatter"] == 1


def test_2d_reduces_partial_sums_and_gathers_no_weights():
    _, found = collectives("2d")
    assert found["all-gather"] == 0 and found["all-to-all"] == 0
    assert found["all-reduce"] > 1  # the row-parallel layers' partial sums, and the gradients
