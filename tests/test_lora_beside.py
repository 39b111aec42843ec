"""LoRA's adapters run beside the frozen weight (``shardplug.core.operations.beside``): a step
computes
``x W + s (x L) R``, never the frozen weight's gradient, and trains as the merged weight
``x (W + s L R)`` did, in every framework."""

import dataclasses
import functools
import itertools
import math
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import shardplug
from shardplug.core.flops import _products, step_flops
from shardplug.core.operations.beside import merged_products
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ShardplugWarning
from shardplug.finetuning.lora import with_lora
from shardplug.loop import program

RANK = 4
STEPS = 3


@functools.cache
def base(framework):
    return shardplug.get_model("transformer").task(framework, layers=2)


@functools.cache
def batches(framework):
    return tuple(itertools.islice(base(framework).batches(), STEPS))


def trained(task, framework, strategy="dp", devices=1):
    run = task.trainer(strategy=strategy, devices=devices, precision="float32")
    rows = run.fit(iter(batches(framework)), STEPS)
    return [r["loss"] for r in rows], jax.tree.map(np.asarray, run.state.params), run.jaxpr


def products(jaxpr):
    """Each matrix product's output shape and FLOPs."""
    return [(tuple(e.outvars[0].aval.shape), f) for e, f in _products(jaxpr)]


def frozen_shapes(params):
    """The shapes of the frozen targets' weights, whole and one layer's."""
    shapes = set()
    for w in jax.tree.leaves(params):
        shapes |= {tuple(w.shape), tuple(w.shape[1:])}
    return shapes


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_a_step_never_computes_a_frozen_weights_gradient_and_trains_as_the_merged_weight(
    framework,
):
    # plain SGD: the factors after the steps are linear in their gradients (Adam's first
    # steps turn a gradient's last bits into a whole step's sign)
    task = with_lora(dataclasses.replace(base(framework), optimizer=optax.sgd(0.5)), RANK)
    got, after, jaxpr = trained(task, framework)
    with merged_products():
        want, merged_after, merged_jaxpr = trained(task, framework)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(after["lora"]), jax.tree.leaves(merged_after["lora"]),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    stored = dict(zip(leaf_paths(after["base"]), jax.tree.leaves(after["base"]), strict=True))
    weights = frozen_shapes([w for p, w in stored.items() if p.replace("/", ".") in after["lora"]])
    made = [shape for shape, _ in products(jaxpr) if shape in weights]
    assert made == [], f"products shaped as a frozen weight: {made}"
    # the merged weight's step computed them: the test sees what it looks for
    assert [shape for shape, _ in products(merged_jaxpr) if shape in weights]
    if framework == "nnx":  # the FLOPs: the frozen weights' gradients gone, the adapters' added
        full = step_flops(trained(base(framework), framework)[2])
        tokens = math.prod(batches(framework)[0]["tokens"].shape)
        gathers = ("embed", "position")
        matrices = [w for p, w in stored.items()
                    if w.ndim >= 2 and p not in gathers and "norm" not in p]  # fmt: skip
        gradients = sum(2 * tokens * w.size for w in matrices)
        adapters = sum(3 * 2 * tokens * (f["l"].size + f["r"].size)  # x L, then by R
                       for f in after["lora"].values())  # fmt: skip
        assert step_flops(jaxpr) == full - gradients + adapters


def _gpt_step_flops(size, adapters, remat="none"):
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_mfu

    task = gpu_mfu.task(size, remat=remat)
    if adapters is not None:
        task = with_lora(task, 16, **adapters)
    trainer = shardplug.Trainer(task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer,
                                strategy="dp", devices=1, allocate=False, precision="bf16")
    sizes = gpu_mfu.SIZES[size]
    batch = gpu_mfu.batches(sizes, sizes.batch, 1)[0]
    return trainer._build(batch, how=program.lower)[2]


def test_the_1b_gpt_lora_step_runs_at_most_0_70_of_a_full_step_s_products():
    full = step_flops(_gpt_step_flops("1b", None))
    for adapters in ({}, {"quantize": "nf4"}):
        ratio = step_flops(_gpt_step_flops("1b", adapters)) / full
        assert ratio <= 0.70, (adapters, ratio)  # 0.6928: 2/3 and the rank-16 adapters


def test_a_rematerialised_block_of_a_users_loop_keeps_its_adapters_beside():
    """The GPT of benchmarks/gpu_mfu.py: NNX's stock layers, a Python loop of nnx.remat
    blocks; its merged weights enter each checkpoint, which is rebuilt on their parts."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardplugWarning)
        jaxpr = _gpt_step_flops("smoke", {}, remat="full")
    with merged_products():
        merged = _gpt_step_flops("smoke", {}, remat="full")
    width = 64
    weights = {(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)}
    assert not [s for s, _ in products(jaxpr) if s in weights]
    assert [s for s, _ in products(merged) if s in weights]


def test_a_weight_the_model_reshapes_is_merged_there_and_said_once():
    import jax.numpy as jnp
    from flax import nnx

    class Folded(nnx.Module):  # reads its kernel cut into heads: a reshape, then a product
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (8, 16)))

        def __call__(self, x):
            return jnp.einsum("bi,ihd->bhd", x, self.w.reshape(8, 4, 4)).reshape(-1, 16)

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    rows = {"x": np.ones((4, 8), np.float32), "y": np.zeros((4, 16), np.float32)}
    task = shardplug.Task(shardplug.from_nnx(Folded), loss_fn, optax.sgd(0.1), data=[rows],
                          name="folded")  # fmt: skip
    tuned = with_lora(task, 2, targets="w")
    with pytest.warns(ShardplugWarning, match=r"lora: the model's reshape reads w's weight, so "
                                              r"its adapter is merged into it there"):  # fmt: skip
        got = [r["loss"] for r in tuned.trainer(devices=1).fit(itertools.repeat(rows), 2)]
    with merged_products():
        want = [r["loss"] for r in tuned.trainer(devices=1).fit(itertools.repeat(rows), 2)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_lora_dropout_drops_the_adapters_input_alike_under_every_layout():
    """PEFT's ``lora_dropout``: ``x W + s (drop(x) L) R``, each mask drawn over the global
    batch, so a layout changes no mask."""
    task = with_lora(base("nnx"), RANK, dropout=0.25)
    one, _, jaxpr = trained(task, "nnx")
    split, _, _ = trained(task, "nnx", strategy="fsdp+tp", devices=4)
    np.testing.assert_allclose(split, one, rtol=1e-5)
    plain, _, _ = trained(with_lora(base("nnx"), RANK), "nnx")
    assert one[0] == pytest.approx(plain[0], rel=1e-6)  # R starts at zero: no adapter yet
    assert abs(one[-1] - plain[-1]) > 1e-5  # then the dropped inputs train the factors
    assert [name for name in ("random_bits", "threefry2x32") if name in str(jaxpr)]
    with pytest.raises(shardplug.errors.ConfigError, match=r"dropout is a probability in"):
        with_lora(base("nnx"), RANK, dropout=1.0)


def test_on_explicit_axes_each_contraction_says_its_layout_and_stays_beside():
    """A model written for explicit axes (tests/explicit_models.py) under fsdp+tp: tp's row
    split makes the adapter's first contraction a sum over a split dimension, which explicit
    axes take only with its output's layout named."""
    import explicit_models as em

    def run():
        adapter = shardplug.LoraAdapter(shardplug.from_nnx(em.Transformer), RANK)
        trainer = shardplug.Trainer(
            adapter, loss_fn=em.lm_loss, optimizer=optax.masked(optax.sgd(0.5),
            adapter.trainable), strategy="fsdp+tp", devices=4, precision="float32",
        )  # fmt: skip
        rows = trainer.fit(itertools.islice(em.lm_batches(), STEPS), STEPS)
        assert trainer.axis_types == "explicit"
        params = trainer.state.params
        targets = [w for p, w in zip(leaf_paths(params["base"]),
                                     jax.tree.leaves(params["base"]), strict=True)
                   if p.replace("/", ".") in params["lora"]]  # fmt: skip
        made = [s for s, _ in products(trainer.jaxpr) if s in frozen_shapes(targets)]
        return [r["loss"] for r in rows], made

    got, made = run()  # a weight merged would warn, and warnings fail the suite
    with merged_products():
        want, made_merged = run()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert made == [] and made_merged


def test_packed_rows_reach_a_lora_stack_s_blocks_and_train_as_the_merged_weight():
    """A layer stack's blocks take packed documents' ids as keywords (``rows=``): the
    rewritten block passes them on."""
    from test_packed import ORDERS, reference_packed

    _, batch = reference_packed(ORDERS)
    for framework in ("nnx", "equinox"):
        task = with_lora(dataclasses.replace(base(framework), optimizer=optax.sgd(0.5)), RANK)

        def losses(task=task):
            run = task.trainer(strategy="fsdp", devices=2, precision="float32")
            return [r["loss"] for r in run.fit(iter([batch] * STEPS), STEPS)]

        got = losses()
        with merged_products():
            want = losses()
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_per_device_program_draws_the_global_batch_s_dropout_masks_or_refuses():
    """pmap (each device its rows) draws the batch's masks and keeps its rows: it trains as
    dp does. A pipeline's stages run products on microbatches inside a per-device program,
    where no mask over the batch exists: refused in one line."""
    task = with_lora(base("nnx"), RANK, dropout=0.25)
    dp, _, _ = trained(task, "nnx", strategy="dp", devices=2)
    pmap, _, _ = trained(task, "nnx", strategy="pmap", devices=2)
    np.testing.assert_allclose(pmap, dp, rtol=1e-5)
    pp = shardplug.get_strategy("pp", schedule="gpipe")
    with pytest.raises(shardplug.errors.ConfigError,
                       match=r"lora dropout on blocks/w\w+: its product runs in a per-device "
                             r"program .* train without --lora-dropout"):  # fmt: skip
        trained(task, "nnx", strategy=pp, devices=2)
