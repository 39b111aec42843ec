"""QLoRA (``train --lora RANK --lora-quantize int8|int4|nf4``): the frozen base stored in its
bits by Qwix, dequantized in the forward pass a layer at a time, training like one device
under every layout; and LoRA's per-layer merge (a layer stack makes each layer's merged
weight inside its loop, never the whole model's)."""

import functools
import itertools

import jax
import numpy as np
import pytest
import qwix
from helpers import said

import shardplug
from shardplug.cli import main
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ConfigError
from shardplug.finetuning.lora import LoraAdapter
from shardplug.finetuning.lora import with_lora as lora
from shardplug.finetuning.quantize import BLOCK, QTYPES, Quantized, quantized
from shardplug.planning.explain import explain

STEPS = 2
RANK = 4
MOE = {"experts": 4, "top_k": 2}
LAYOUTS = {  # strategy: (options, devices)
    "fsdp": ({"min_size": 0}, 2),
    "tp": ({}, 2),
    "fsdp+tp": ({"min_size": 0}, 4),
    "pp+fsdp": ({"schedule": "gpipe"}, 4),
    "fsdp+cp": ({"min_size": 0}, 4),
    "dp+ep": ({}, 4),
}


@functools.cache
def base(framework="nnx", moe=False, layers=2, remat="none"):
    return shardplug.get_model("transformer").task(framework, layers=layers, remat=remat,
                                                   **(MOE if moe else {}))  # fmt: skip


@functools.cache
def batches(framework="nnx", moe=False):
    return tuple(itertools.islice(base(framework, moe).batches(), STEPS))


@functools.cache
def losses(strategy, qtype, framework="nnx", moe=False):
    options, devices = LAYOUTS.get(strategy, ({}, 1))
    run = lora(base(framework, moe), RANK, quantize=qtype).trainer(
        strategy=shardplug.get_strategy("dp" if strategy == "one" else strategy, **options),
        devices=devices, precision="float32",
    )  # fmt: skip
    before = jax.tree.map(np.asarray, run.state.params)
    rows = run.fit(iter(batches(framework, moe)), STEPS)
    return [r["loss"] for r in rows], before, jax.tree.map(np.asarray, run.state.params), run


@pytest.mark.parametrize(
    ("qtype", "strategy", "framework"),
    [("nf4", "fsdp+tp", "nnx"), ("nf4", "pp+fsdp", "nnx"), ("int8", "fsdp", "nnx"),
     ("int4", "tp", "nnx"), ("nf4", "fsdp+tp", "linen"), ("nf4", "fsdp+tp", "equinox")],
)  # fmt: skip
def test_a_quantized_base_trains_as_on_one_device(qtype, strategy, framework):
    want, _, _, _ = losses("one", qtype, framework)
    got, _, _, _ = losses(strategy, qtype, framework)
    assert got[-1] < got[0] or STEPS == 1
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tp", "fsdp+cp", "dp+ep"])
def test_every_layout_trains_a_4_bit_base_as_one_device(strategy):
    moe = strategy == "dp+ep"
    want, _, _, _ = losses("one", "nf4", moe=moe)
    got, _, _, _ = losses(strategy, "nf4", moe=moe)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_the_base_is_stored_in_its_bits_and_stays_frozen():
    _, before, after, run = losses("one", "nf4")
    plain = base().trainer(strategy="dp", devices=1, precision="float32", allocate=False)
    stored = run.state.params["base"]
    held = jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, Quantized))
    for path, w, got in zip(leaf_paths(plain.state.params), jax.tree.leaves(plain.state.params),
                            held, strict=True):  # fmt: skip
        if path.startswith("blocks/w"):  # the targets: a byte holds two values
            assert isinstance(got, Quantized) and got.values.dtype == np.uint8
            assert got.values.size * 2 == w.size and got.shape == w.shape
            last_input = w.shape[2] if path == "blocks/wo" else w.shape[1]  # wo: (heads, kv)
            assert got.scale.size * min(BLOCK, last_input) == w.size
        else:
            assert not isinstance(got, Quantized)
    for a, b in zip(jax.tree.leaves(before["base"]), jax.tree.leaves(after["base"]), strict=True):
        np.testing.assert_array_equal(a, b)
    report = explain(run, batches()[0]).to_dict()["per_device"]
    quantized_bytes = sum(x.nbytes for x in jax.tree.leaves(stored))
    assert report["params_bytes"] == quantized_bytes + sum(
        x.nbytes for x in jax.tree.leaves(run.state.params["lora"]))  # fmt: skip


@pytest.mark.parametrize("qtype", ["int8", "int4", "nf4"])
def test_each_weight_comes_back_as_qwix_dequantizes_it(qtype):
    w = jax.random.normal(jax.random.key(1), (3, 128, 6, 10))  # layers, input, heads, width
    got = quantized(w, qtype, 1, 2)
    how = {"channelwise_axes": (0, 2, 3)}
    if qtype != "int8":
        how["tiled_axes"] = {1: BLOCK}
    want = qwix.dequantize(qwix.quantize(w, QTYPES[qtype], **how))
    np.testing.assert_array_equal(got.dequantized(), want)
    one = jax.tree.map(lambda x: x[1], got)  # a layer stack's slice keeps its packing
    np.testing.assert_array_equal(one.dequantized(), want[1])
    assert float(np.abs(np.asarray(want) - np.asarray(w)).max()) < {"int8": 0.05}.get(qtype, 0.8)


def test_the_first_step_is_the_dequantized_models():
    got, before, _, _ = losses("one", "int8")
    plain = base().trainer(strategy="dp", devices=1, precision="float32")
    tree = jax.tree.structure(plain.state.params)
    stored = jax.tree.leaves(before["base"], is_leaf=lambda x: isinstance(x, Quantized))
    weights = [w.dequantized() if isinstance(w, Quantized) else w for w in stored]
    plain.state = plain.state._replace(params=jax.tree.unflatten(tree, weights))
    assert plain.fit(iter(batches()[:1]), 1)[0]["loss"] == pytest.approx(got[0], rel=1e-6)


def test_a_stack_merges_its_adapters_a_layer_at_a_time():
    """The temporaries grow with depth by the blocks' saved inputs, not by a merged weight
    and its gradient per layer, which a merge of the whole model before the stack adds."""
    temps, inputs = {}, {}
    for layers in (2, 6):
        task = lora(base(layers=layers, remat="full"), RANK)
        run = task.trainer(strategy="dp", devices=1, precision="float32", allocate=False)
        batch = next(iter(task.batches()))
        temps[layers] = explain(run, batch).to_dict()["per_device"]["temp_bytes"]
        stacked = [x for p, x in zip(leaf_paths(run.state.params["base"]),
                                     jax.tree.leaves(run.state.params["base"]), strict=True)
                   if p.startswith("blocks/")]  # fmt: skip
        weights = sum(x.size * x.dtype.itemsize for x in stacked) // layers
        inputs = batch["tokens"].size * 64 * 4  # a block's input: (rows, sequence, width) f32
    per_layer = (temps[6] - temps[2]) / 4
    assert per_layer < inputs + weights / 2, (per_layer, inputs, weights)


def test_the_command_line_trains_resumes_and_exports_a_quantized_base(tmp_path, capsys):
    from shardplug import pretrained

    fixture, ckpt, out = "tests/fixtures/hf/llama", tmp_path / "c", tmp_path / "merged"
    train = ["train", "--init-from", fixture, "--devices", "2", "--strategy", "fsdp", "--lora",
             "4", "--lr", "0.01", "--checkpoint-dir", str(ckpt),
             "--checkpoint-every", "2"]  # fmt: skip
    assert main([*train, "--steps", "2", "--lora-quantize", "nf4", "--quiet"]) == 0
    assert "(16.6%); the targets stored in nf4" in capsys.readouterr().err
    resume = ["train", "--resume", "--checkpoint-dir", str(ckpt), "--devices", "2", "--quiet"]
    assert main([*resume, "--steps", "3", "--strategy", "tp"]) == 0
    assert main([*resume, "--steps", "4", "--lora-quantize", "int8"]) == 2
    assert said(capsys.readouterr().err)[-1] == (
        f"shardplug: error: --lora-quantize int8: the run in {ckpt} was trained with lora "
        "quantize nf4, and a resumed run continues its adapters: drop --lora-quantize, or train "
        "anew in another --checkpoint-dir"
    )
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out", str(out), "--format", "hf",
                 "--merge"]) == 0  # fmt: skip
    tuned = lora(pretrained.load(fixture).task("nnx"), 4, quantize="nf4")
    run = tuned.trainer(strategy="dp", devices=1, precision="float32", checkpoint_dir=ckpt)
    assert run.restore() == 3
    merged = pretrained.load(out).task("nnx").trainer(strategy="dp", devices=1,
                                                      precision="float32")  # fmt: skip
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    np.testing.assert_allclose(np.asarray(merged.model(tokens)), np.asarray(run.model(tokens)),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_bad_quantization_is_one_line(capsys):
    assert main(["train", "--steps", "1", "--lora-quantize", "nf4"]) == 2
    assert said(capsys.readouterr().err) == [
        "shardplug: error: --lora-quantize stores the frozen base that adapters train on "
        "(QLoRA): give --lora RANK too"
    ]
    with pytest.raises(ConfigError, match="quantize must be one of int8, int4, nf4, got 'fp8'"):
        LoraAdapter(base().adapter, 2, quantize="fp8")
