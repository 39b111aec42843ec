"""Each strategy's compiled step communicates as the strategy promises (read from the HLO)."""

import collections
import re

import jax
import optax
import pytest

import shardplug
from shardplug.core.compiled import hlo

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


def test_fsdp_gathers_each_layer_forward_and_backward_and_moves_no_activations():
    trainer, found = collectives("fsdp")
    sharded = [s for s in jax.tree.leaves(trainer.param_shardings) if not s.is_fully_replicated]
    assert len(sharded) == 9  # six stacked block matrices, the embeddings and the head
    # each stacked matrix gathered one layer at a time in the forward scan and again in the
    # backward one (ZeRO-3), the rest once
    per_step = {c.kind: c.count for c in hlo.collectives(trainer.compiled.as_text())}
    assert per_step["all-gather"] == 6 * 2 * 2 + 3
    assert found["all-gather"] == 6 * 2 + 3  # ops in the program: one per loop
    assert found["all-to-all"] == 0 and found["collective-permute"] == 0
    # the gradients: one reduction (an all-reduce feeding each shard's slice on CPU,
    # a reduce-scatter where the backend has one)
    # (one in the backward scan for the stack, one for the rest)
    assert found["all-reduce"] + found["reduce-scatter"] == 2


def test_2d_reduces_partial_sums_and_gathers_no_weights():
    _, found = collectives("2d")
    assert found["all-gather"] == 0 and found["all-to-all"] == 0
    assert found["all-reduce"] > 1  # the row-parallel layers' partial sums, and the gradients


def test_the_program_says_which_branches_differ_between_devices():
    """A conditional on each device's index runs another branch on some devices (pp's
    passes); one on a value every device shares does not (pp's sends): read from the
    compiled program's structure, a loop carrying the index round included."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=auto, devices=jax.devices()[:8])

    def per_device(x, flags):
        stage = jax.lax.axis_index("stage")

        def tick(x, flag):
            x = jax.lax.cond(stage == 0, lambda: x * 2, lambda: x + 1)  # differs
            x = jax.lax.cond(flag > 0, lambda: jax.lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
                             lambda: x)  # fmt: skip  # the same on every device
            return x, None

        return jax.lax.scan(tick, x, flags)[0]

    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("stage"), P()),
                                    out_specs=P("stage")))  # fmt: skip
    text = program.lower(jnp.ones((8, 4)), jnp.arange(5)).compile().as_text()
    structure = hlo.computations(text)
    divergent = hlo.Varying(structure).divergent()
    conditionals = [i for ins in structure.values() for i in ins if i.opcode == "conditional"]
    assert len(conditionals) == 2 and len(divergent) == 1
    _, cond = divergent[0]
    inside = [i.opcode for _, b in cond.calls for i in hlo.reached(structure, b)]
    assert "collective-permute" not in inside  # the send is in the other, uniform, one
