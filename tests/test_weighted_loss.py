"""A loss weighted by tokens, ``sum(ce * w) / sum(w)``, declared as ``shardplug.Mean``: the
whole batch's loss and gradient wherever the step cuts the batch (``grad_accum``, every pp
schedule, a per-device program, compositions), equal to one device's; undeclared, the step
averages its parts' means and says so once."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplug
from shardplug.core.means import WEIGHT
from shardplug.errors import ConfigError, unsay
from shardplug.models import _forward

STEPS, ROWS, LAYERS = 3, 32, 4
TOL = 1e-5


def weights(kind: str, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A masked-LM's scored positions (about 15%, some rows none) or a padded causal LM's
    (each row a random length, the rest padding): counts that differ between any two parts
    of the batch."""
    rows, seq = tokens.shape
    if kind == "masked":
        w = rng.random((rows, seq)) < 0.15
        w[rng.integers(0, rows, 3)] = False  # rows with nothing scored
        return w.astype(np.float32)
    lengths = rng.integers(1, seq + 1, rows)
    return (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)


@functools.cache
def batches(kind: str) -> tuple:
    model = shardplug.get_model("transformer")
    rng = np.random.default_rng(1)
    out = []
    for batch in model.batches(ROWS, 0):
        out.append({**batch, "w": weights(kind, batch["tokens"], rng)})
        if len(out) == STEPS:
            return tuple(out)
    raise AssertionError


def declared(model, batch, rng=None, train=True):
    logits, _ = _forward(model, batch["tokens"], rng, train, None)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    w = batch["w"]
    accuracy = (jnp.argmax(logits, -1) == batch["targets"]) * w
    return shardplug.Mean(jnp.sum(ce * w), jnp.sum(w)), {
        "scored": shardplug.Mean(jnp.sum(accuracy), jnp.sum(w)),
        "plain": jnp.mean(ce),
    }


def undeclared(model, batch, rng=None, train=True):
    logits, _ = _forward(model, batch["tokens"], rng, train, None)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    return jnp.sum(ce * batch["w"]) / jnp.maximum(jnp.sum(batch["w"]), 1.0)


def rows(kind, strategy, adapter, loss_fn=declared, devices=1, **options):
    model = shardplug.get_model("transformer")
    task = shardplug.Task(model.adapter(adapter, layers=LAYERS), loss_fn, optax.adam(3e-3), data=())
    trainer = task.trainer(
        strategy=strategy, devices=devices, precision="float32", seed=0, **options
    )
    return trainer.fit(list(batches(kind)), steps=STEPS)


@functools.cache
def one_device(kind, adapter):
    return rows(kind, "dp", adapter)


def assert_like_one_device(got, kind, adapter):
    want = one_device(kind, adapter)
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "scored", "plain"):
            assert g[key] == pytest.approx(w[key], rel=TOL), (key, got, want)
        assert not any(k.startswith(WEIGHT) for k in g)  # the counts are not reported


def pp(schedule, **more):
    return shardplug.get_strategy("pp", schedule=schedule, microbatches=4, **more)


CUTS = {
    "grad-accum": lambda: ("dp", 4, {"grad_accum": 4}),
    "pmap": lambda: ("pmap", 4, {}),
    "pmap+grad-accum": lambda: ("pmap", 2, {"grad_accum": 2}),
    "pp-zb": lambda: (pp("zb"), 4, {}),
    "pp-1f1b": lambda: (pp("1f1b"), 2, {}),
    "pp-interleaved": lambda: (pp("interleaved-1f1b", repeats=2), 2, {}),
    "pp-zbv": lambda: (pp("zbv"), 2, {}),
    "pp-gpipe": lambda: (pp("gpipe"), 4, {}),
    "pp+dp": lambda: ("pp+dp", 4, {"mesh": {"stage": 2, "data": 2}}),
    "pp+fsdp+tp": lambda: ("pp+fsdp+tp", 8, {"mesh": {"stage": 2, "fsdp": 2, "model": 2}}),
    "fsdp+tp": lambda: ("fsdp+tp", 8, {"mesh": {"fsdp": 4, "model": 2}, "grad_accum": 2}),
}


@pytest.mark.parametrize("cut", CUTS)
def test_a_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut(cut):
    strategy, devices, options = CUTS[cut]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a declared loss is never told it is averaged
        got = rows("masked", strategy, "nnx", devices=devices, **options)
    assert_like_one_device(got, "masked", "nnx")


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("cut", ["grad-accum", "pp-zb"])
@pytest.mark.parametrize("kind", ["masked", "padded"])
def test_a_weighted_loss_is_the_whole_batchs_in_every_framework(kind, cut, adapter):
    """A masked LM's and a padded causal LM's loss in NNX, Linen and Equinox (the Linen and
    Equinox rows in CI's slow run, as the other matrices')."""
    strategy, devices, options = CUTS[cut]()
    got = rows(kind, strategy, adapter, devices=devices, **options)
    assert_like_one_device(got, kind, adapter)


def test_an_undeclared_weighted_loss_is_averaged_over_microbatches_and_said_once():
    unsay([m for m in _said() if "own losses" in m])
    with pytest.warns(
        shardplug.ShardplugWarning,
        match=r"mean of its parts' own losses \(4 microbatches, "
        r"--grad-accum\).*shardplug\.Mean\(sum\(l \* w\), sum\(w\)\)",
    ) as said:
        got = rows("masked", "dp", "nnx", loss_fn=undeclared, devices=4, grad_accum=4)
    assert len([w for w in said if "own losses" in str(w.message)]) == 1
    want = rows("masked", "dp", "nnx", loss_fn=undeclared)
    # the objective it trains is the microbatches' mean of means: not one device's
    assert abs(got[0]["loss"] - want[0]["loss"]) > 1e-3


def test_pp_says_so_too_and_a_row_mean_loss_is_never_told():
    unsay([m for m in _said() if "own losses" in m])
    model = shardplug.get_model("transformer")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rows("masked", pp("zb"), "nnx", loss_fn=lambda m, b: model.loss_fn(m, b), devices=4)
        rows("masked", "dp", "nnx", loss_fn=lambda m, b: model.loss_fn(m, b), devices=2,
             grad_accum=2)  # fmt: skip
    assert not [w for w in said if "own losses" in str(w.message)]
    with pytest.warns(shardplug.ShardplugWarning, match=r"own losses \(4 microbatches of pp\)"):
        rows("masked", pp("zb"), "nnx", loss_fn=undeclared, devices=4)


@pytest.mark.parametrize(
    ("strategy", "where"),
    [("pmap", "each device's rows, a per-device program"),
     (shardplug.get_strategy("dp", addons=["grad-bf16"]), "each batch shard's rows, encode_grads")],
)  # fmt: skip
def test_devices_averaging_their_own_means_say_so_too(strategy, where):
    unsay([m for m in _said() if "own losses" in m])
    with pytest.warns(shardplug.ShardplugWarning, match=f"own losses \\({where}\\)"):
        rows("masked", strategy, "nnx", loss_fn=undeclared, devices=4)


def test_a_bfloat16_total_is_summed_and_divided_in_float32():
    total, count = shardplug.core.means.declared(
        "the loss", shardplug.Mean(jnp.asarray(1001.0, jnp.bfloat16), 1001.0)
    )
    assert total.dtype == jnp.float32 and float(count) == 1001.0
    assert float(total) == pytest.approx(1000.0 / 1001.0)  # bfloat16(1001) is 1000


def _said():
    from shardplug.errors import _SAID

    return list(_SAID)


def test_evaluation_weighs_each_batch_by_its_count():
    model = shardplug.get_model("transformer")
    task = shardplug.Task(model.adapter("nnx", layers=LAYERS), declared, optax.adam(3e-3),
                          data=())  # fmt: skip
    trainer = task.trainer(strategy="pmap", devices=4, precision="float32", seed=0)
    data = list(batches("masked"))
    got = trainer.evaluate(data)
    one = task.trainer(strategy="dp", devices=1, precision="float32", seed=0)
    whole = one.evaluate([{k: np.concatenate([b[k] for b in data]) for k in data[0]}])
    assert got["loss"] == pytest.approx(whole["loss"], rel=TOL)
    assert got["scored"] == pytest.approx(whole["scored"], rel=TOL)
    assert not any(k.startswith(WEIGHT) for k in got)


def test_a_batch_with_nothing_scored_has_loss_zero_and_changes_nothing():
    empty = [{**b, "w": np.zeros_like(b["w"])} for b in batches("masked")]
    model = shardplug.get_model("transformer")
    task = shardplug.Task(model.adapter("nnx", layers=LAYERS), declared, optax.sgd(0.1),
                          data=())  # fmt: skip
    trainer = task.trainer(strategy="dp", devices=4, precision="float32", grad_accum=2)
    trainer.allocate()
    before = jax.device_get(trainer.state.params)
    assert [r["loss"] for r in trainer.fit(empty[:1], steps=1)] == [0.0]
    after = jax.device_get(trainer.state.params)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        (
            lambda m, b: shardplug.Mean(jnp.ones(3), 3.0),
            r"the loss is a shardplug\.Mean whose "
            r"total has shape \(3,\): give its total and count as scalars",
        ),
        (
            lambda m, b: (jnp.zeros(()), {"acc": shardplug.Mean(1.0, jnp.ones(2))}),
            r"metric 'acc' is a shardplug\.Mean whose count has shape \(2,\)",
        ),
    ],
)
def test_a_mean_that_is_not_two_scalars_is_one_line(loss, match):
    model = shardplug.get_model("mlp")
    task = shardplug.Task(model.adapter("nnx"), loss, optax.sgd(0.1), data=())
    trainer = task.trainer(strategy="dp", devices=2)
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model.batches(8, 0), steps=1)


def test_gradients_reduced_in_bfloat16_weigh_each_shard_by_its_count():
    """grad-bf16 computes each batch shard's gradient apart (a vmap over the shards): the first
    step's loss is one device's exactly, the next within bfloat16's reduction."""
    strategy = shardplug.get_strategy("dp", addons=["grad-bf16"])
    got = rows("masked", strategy, "nnx", devices=4)
    want = one_device("masked", "nnx")
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-6)
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-2)
