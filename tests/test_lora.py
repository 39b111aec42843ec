"""LoRA (``shardplug.finetuning.lora``, ``train --lora RANK``): the base frozen (no gradient
computed or
sent, no optimizer state), the first step's loss the base model's exactly, the adapters laid
out like their weights, the same training as one device under every layout and framework,
and bad input in one line."""

import functools
import itertools
import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import said

import shardplug
from shardplug.cli import main
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ConfigError
from shardplug.finetuning.lora import LoraAdapter
from shardplug.finetuning.lora import with_lora as lora
from shardplug.planning.explain import explain

STEPS = 3
RANK = 4
MOE = {"experts": 4, "top_k": 2}
# strategy (options), devices
LAYOUTS = {
    "dp": ({}, 2),
    "fsdp": ({"min_size": 0}, 2),
    "tp": ({}, 2),
    "fsdp+tp": ({"min_size": 0}, 4),
    "fsdp+cp": ({"min_size": 0}, 4),
    "pp+fsdp": ({"schedule": "gpipe"}, 4),  # its tick schedules need the stack as stored
    "dp+ep": ({}, 4),
}


@functools.cache
def base(framework="nnx", moe=False):
    return shardplug.get_model("transformer").task(framework, layers=2, **(MOE if moe else {}))


@functools.cache
def batches(framework="nnx", moe=False):
    return tuple(itertools.islice(base(framework, moe).batches(), STEPS))


@functools.cache
def losses(strategy, framework="nnx", moe=False, adapters=True):
    task = lora(base(framework, moe), RANK) if adapters else base(framework, moe)
    options, devices = LAYOUTS.get(strategy, ({}, 1))  # "one": one device
    name = "dp" if strategy == "one" else strategy
    run = task.trainer(strategy=shardplug.get_strategy(name, **options), devices=devices,
                       precision="float32")  # fmt: skip
    before = jax.tree.map(np.asarray, run.state.params)
    rows = run.fit(iter(batches(framework, moe)), STEPS)
    return [r["loss"] for r in rows], before, jax.tree.map(np.asarray, run.state.params)


def test_the_first_step_is_the_base_models_and_only_the_adapters_change():
    plain, _, _ = losses("one", adapters=False)
    got, before, after = losses("one")
    assert got[0] == plain[0]  # the up-projections start at zero: the same model, exactly
    assert got[-1] < got[0]
    for a, b in zip(jax.tree.leaves(before["base"]), jax.tree.leaves(after["base"]), strict=True):
        np.testing.assert_array_equal(a, b)  # frozen, to the last bit
    assert all(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(before["lora"]), jax.tree.leaves(after["lora"]), strict=True))  # fmt: skip


def test_only_the_adapters_have_optimizer_state_and_gradients_sent():
    task = lora(base(), RANK)
    run = task.trainer(strategy="dp", devices=2, precision="float32", allocate=False)
    report = explain(run, batches()[0]).to_dict()
    factors = run.state.params["lora"]
    factor_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(factors))
    per_device = report["per_device"]
    assert per_device["opt_state_bytes"] == 2 * factor_bytes + 4  # Adam's mu, nu; its count
    assert per_device["grads_bytes"] == factor_bytes
    # dp sends each step the adapters' gradients and nothing of the base's
    sent = [c for c in report["collectives"] if c["kind"] == "all-reduce"]
    assert sum(c["bytes"] for c in sent) == factor_bytes + 4  # and the loss's mean
    held = [x.shape for x in jax.tree.leaves(run.state.opt_state) if x.ndim]
    assert sorted(held) == sorted([x.shape for x in jax.tree.leaves(factors)] * 2)


def test_the_adapters_are_laid_out_as_their_weights_input_and_output():
    task = lora(base(), RANK)
    run = task.trainer(strategy="tp", devices=2, precision="float32", allocate=False)
    specs = dict(zip(leaf_paths(run.state.params), (tuple(s.spec) for s in
                 jax.tree.leaves(run.state_shardings.params)), strict=True))  # fmt: skip
    for path, (lead, cut, ndim) in ((p, c) for p, c in task.adapter.cuts.items() if c):
        weight = specs[f"base/{path}"] + (None,) * ndim
        left = specs[f"lora/{path.replace('/', '.')}/l"] + (None,) * ndim
        right = specs[f"lora/{path.replace('/', '.')}/r"] + (None,) * ndim
        assert left[:cut] == weight[:cut] and left[cut] is None, path  # the input's split
        assert right[lead + 1 : ndim - cut + lead + 1] == weight[cut:ndim], path  # the output's
    # tensor parallelism splits the MLP's hidden dimension: its up-projection's R, down's L
    assert specs["lora/blocks.wi/r"][2] == "model" and specs["lora/blocks.wf/l"][1] == "model"


def test_each_expert_has_adapters_of_its_own_split_as_its_weights():
    task = lora(base(moe=True), RANK)
    cuts = task.adapter.cuts
    assert cuts["blocks/experts_in"] == (2, 3, 4) and cuts.get("blocks/router") is None
    run = task.trainer(strategy="dp+ep", devices=4, precision="float32", allocate=False)
    specs = dict(zip(leaf_paths(run.state.params), (tuple(s.spec) for s in
                 jax.tree.leaves(run.state_shardings.params)), strict=True))  # fmt: skip
    for factor in ("l", "r"):  # (layers, expert, ...): split over the experts as the weight
        assert specs[f"lora/blocks.experts_in/{factor}"][:2] == specs["base/blocks/experts_in"][:2]
    assert run.state.params["lora"]["blocks.experts_in"]["l"].shape == (2, 4, 64, RANK)


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_a_lora_fine_tune_trains_as_on_one_device(strategy):
    moe = strategy.endswith("ep")
    want, _, _ = losses("one", moe=moe)
    got, _, _ = losses(strategy, moe=moe)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("framework", ["linen", "equinox"])
def test_every_framework_fine_tunes_alike_under_fsdp_tp(framework):
    want, _, _ = losses("one", framework)
    got, _, _ = losses("fsdp+tp", framework)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    plain, _, _ = losses("one", framework, adapters=False)
    # the same model at first: its merged weights are the base's to the last bit (the
    # compiled programs differ, so the loss may in its last digits)
    task = lora(base(framework), RANK)
    params, _ = task.adapter.init(jax.random.key(0))
    merged = task.adapter.merged(params)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params["base"]), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(want[0], plain[0], rtol=1e-6)


def test_the_command_line_fine_tunes_a_pretrained_model_and_resumes_its_adapters(tmp_path, capsys):
    fixture = "tests/fixtures/hf/llama"
    common = ["train", "--init-from", fixture, "--devices", "2", "--strategy", "fsdp",
              "--log-every", "1"]  # fmt: skip
    assert main([*common, "--steps", "2"]) == 0
    plain_first = _first_loss(capsys.readouterr().out)
    ckpt = tmp_path / "c"
    saving = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    assert main([*common, "--steps", "2", "--lora", "4", "--lora-alpha", "8", *saving]) == 0
    out = capsys.readouterr()
    assert _first_loss(out.out) == plain_first
    lines = [x for x in out.err.splitlines() if x.startswith("shardplug: lora")]
    assert lines == ["shardplug: lora rank 4, alpha 8 on 7 weights: 4.1k trainable parameters "
                     "beside 24.7k frozen (16.6%); chosen by their use in the traced step: "
                     "linear layers, not the embedding, head"]  # fmt: skip
    resume = ["train", "--resume", "--checkpoint-dir", str(ckpt), "--devices", "2"]
    assert main([*resume, "--steps", "3"]) == 0  # the adapters come back from the checkpoint
    assert "from step 2" in capsys.readouterr().out
    assert main([*resume, "--steps", "4", "--lora", "8"]) == 2
    assert said(capsys.readouterr().err) == [
        f"shardplug: error: --lora 8: the run in {ckpt} was trained with lora 4, and a resumed "
        "run continues its adapters: drop --lora, or train anew in another --checkpoint-dir"
    ]


def _first_loss(out):
    return next(line for line in out.splitlines() if "loss" in line).split("loss ")[1].split()[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-alpha", "2"], "--lora-alpha shapes the adapters: give --lora RANK too"),
        (["--lora-dropout", "0.1"], "--lora-dropout shapes the adapters: give --lora RANK too"),
        (["--lora", "2", "--lora-dropout", "1"],
         "argument --lora-dropout: must be a probability in [0, 1), got 1 (see shardplug "
         "train --help)"),
        (["--lora", "2", "--lora-targets", "nothing_like_this"],
         "lora: targets 'nothing_like_this' match no weight of this model; its parameters are "
         "blocks/norm1/bias, blocks/norm1/scale, blocks/norm2/bias, blocks/norm2/scale, "
         "blocks/wf, blocks/wi: give targets, a pattern searched in these paths"),
        (["--lora", "2", "--lora-targets", "norm"],
         "lora: targets 'norm' match blocks/norm1/bias, of shape (2, 64) and float32: an adapter "
         "needs a floating-point weight with an input and an output dimension; narrow the "
         "pattern"),
        (["--lora", "2", "--lora-targets", "("],
         "lora: targets '(' is not a regular expression (missing ), unterminated subpattern at "
         "position 0)"),
    ],
)  # fmt: skip
def test_bad_adapters_are_one_line(argv, message, capsys):
    assert main(["train", "--steps", "1", *argv]) == 2
    assert said(capsys.readouterr().err) == [f"shardplug: error: {message}"]


def test_from_python_bad_adapters_are_typed_errors():
    with pytest.raises(ConfigError, match="rank must be a positive integer, got 0"):
        LoraAdapter(base().adapter, 0)
    with pytest.raises(ConfigError, match="already has adapters"):
        LoraAdapter(lora(base(), 2).adapter, 2)
    assert math.isclose(LoraAdapter(base().adapter, 8, alpha=16).scale, 2.0)


def test_a_merged_export_gives_the_logits_of_the_base_with_its_adapters(tmp_path, capsys):
    from shardplug import pretrained

    fixture, ckpt, out = "tests/fixtures/hf/llama", tmp_path / "c", tmp_path / "merged"
    assert main(["train", "--init-from", fixture, "--devices", "1", "--steps", "2", "--lora",
                 "4", "--lr", "0.01", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                 "--quiet"]) == 0  # fmt: skip
    export = ["export", "--checkpoint-dir", str(ckpt), "--out", str(out), "--format", "hf"]
    capsys.readouterr()
    assert main(export) == 2
    assert said(capsys.readouterr().err) == [
        f"shardplug: error: {ckpt}: the run trained low-rank adapters (--lora 4): give --merge "
        "to write them merged into the base's weights"
    ]
    assert not out.exists()
    assert main([*export, "--merge"]) == 0
    tuned = lora(pretrained.load(fixture).task("nnx"), 4)
    run = tuned.trainer(strategy="dp", devices=1, precision="float32", checkpoint_dir=ckpt)
    assert run.restore() == 2
    plain = pretrained.load(out).task("nnx").trainer(strategy="dp", devices=1,
                                                     precision="float32")  # fmt: skip
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    want, got = np.asarray(run.model(tokens)), np.asarray(plain.model(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    base = pretrained.load(fixture).task("nnx").trainer(strategy="dp", devices=1,
                                                        precision="float32")  # fmt: skip
    assert np.abs(np.asarray(base.model(tokens)) - want).max() > 1e-3  # the adapters moved it
    # the checkpoints hold no base: the whole parameters cannot go to .npz, and a merge reads
    # the base again, refusing one that is not the run's
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "w.npz")]) == 2
    assert said(capsys.readouterr().err) == [
        f"shardplug: error: {ckpt}: its checkpoints hold low-rank adapters without their frozen "
        "base: export --format peft writes the adapters; a pretrained run's whole model, export "
        "--format hf --merge"
    ]
    other = tmp_path / "other"
    shutil.copytree(fixture, other)
    shard = other / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    assert main([*export[:4], str(tmp_path / "m2"), *export[5:], "--merge", "--init-from",
                 str(other)]) == 2  # fmt: skip
    err = said(capsys.readouterr().err)
    assert len(err) == 1 and "is not the base the run's adapters were trained on" in err[0]
    assert not (tmp_path / "m2" / "model.safetensors").exists()


PEFT = "tests/fixtures/hf/llama_lora"  # written by PEFT: scripts/hf_fixtures.py --lora


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_peft_adapters_give_the_references_logits(framework):
    from shardplug.cli.config import RunConfig
    from shardplug.cli.tasks import task_of

    reference = np.load(f"{PEFT}/reference.npz")
    config = RunConfig(init_from="tests/fixtures/hf/llama", lora_from=PEFT, adapter=framework)
    task = task_of(config).task
    assert (task.adapter.rank, task.adapter.alpha, len(task.adapter.targets())) == (4, 8.0, 7)
    run = task.trainer(strategy="fsdp", devices=2, precision="float32")
    got = np.asarray(run.model(reference["tokens"]))
    np.testing.assert_allclose(got, reference["logits"], rtol=1e-5, atol=1e-5)


def test_adapters_go_out_in_peft_format_and_come_back(tmp_path, capsys):
    import json

    from shardplug.pretrained.safetensors import Tensors

    ckpt, out = tmp_path / "c", tmp_path / "adapters"
    assert main(["train", "--init-from", "tests/fixtures/hf/llama", "--lora-from", PEFT,
                 "--devices", "2", "--steps", "2", "--lr", "0.01", "--checkpoint-dir",
                 str(ckpt), "--checkpoint-every", "2", "--quiet", "--lora-dropout", "0.05"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--checkpoint-dir", str(ckpt), "--steps", "3",
                 "--lora-dropout", "0.1"]) == 2  # fmt: skip
    assert said(capsys.readouterr().err) == [
        f"shardplug: error: --lora-dropout 0.1: the run in {ckpt} was trained with lora "
        "dropout 0.05, and a resumed run continues its adapters: drop --lora-dropout, or train "
        "anew in another --checkpoint-dir"]  # fmt: skip
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out", str(out), "--format",
                 "peft"]) == 0  # fmt: skip
    mine, theirs = Tensors(out), Tensors(PEFT)
    assert {n: mine.shape(n) for n in mine.names()} == {n: theirs.shape(n) for n in theirs.names()}
    config, reference = (json.loads((d / "adapter_config.json").read_text())
                         for d in (out, Path(PEFT)))  # fmt: skip
    keys = ("peft_type", "r", "lora_alpha", "task_type", "bias", "fan_in_fan_out", "use_rslora")
    assert {k: config[k] for k in keys} == {k: reference[k] for k in keys}
    assert sorted(config["target_modules"]) == sorted(reference["target_modules"])
    assert config["lora_dropout"] == 0.05  # the run's, as PEFT trains with it
    # trained: moved from PEFT's values; read back, they make the trained run's model
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    assert not np.array_equal(mine.read(name), theirs.read(name))
    from shardplug.cli.config import RunConfig
    from shardplug.cli.tasks import task_of

    config = RunConfig(init_from="tests/fixtures/hf/llama", lora_from=str(out))
    back = task_of(config).task.trainer(strategy="dp", devices=1, precision="float32")
    tuned = task_of(RunConfig(init_from="tests/fixtures/hf/llama", lora_from=PEFT)).task
    trained = tuned.trainer(strategy="dp", devices=1, precision="float32", checkpoint_dir=ckpt)
    assert trained.restore() == 2
    tokens = np.load(f"{PEFT}/reference.npz")["tokens"]
    np.testing.assert_allclose(np.asarray(back.model(tokens)), np.asarray(trained.model(tokens)),
                               atol=1e-6)  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--lora-from", PEFT, "--steps", "1"]) == 2
    assert said(capsys.readouterr().err) == [
        "shardplug: error: --lora-from reads PEFT's adapters of a pretrained family: give "
        "--init-from DIR, the model they adapt"
    ]


def test_adapters_train_alike_with_their_optimizer_state_off_the_devices():
    want, _, _ = losses("fsdp")
    options, devices = LAYOUTS["fsdp"]
    for offload in ({}, {"offload.update": "host"}):
        task = lora(base(), RANK)
        strategy = shardplug.get_strategy("fsdp", addons=["offload"], **options, **offload)
        run = task.trainer(strategy=strategy, devices=devices, precision="float32")
        got = [r["loss"] for r in run.fit(iter(batches()), STEPS)]
        assert got == want, offload


def test_the_default_targets_leave_heads_routers_and_unnamed_kernels_alone():
    for name, expected in (("mlp", ["fc1/kernel", "fc2/kernel"]),
                           ("classifier", ["fc1/kernel", "fc2/kernel"])):  # fmt: skip
        assert lora(shardplug.get_model(name).task("nnx"), 8).adapter.targets() == expected
    with pytest.raises(ConfigError, match="the default targets match no weight of this model"):
        lora(shardplug.get_model("cnn").task("nnx"), 8)  # its kernels' dimensions: unnamed
    with pytest.raises(ConfigError, match="rank 64 is not below its input"):
        lora(base(), 64, targets="wi")
    # a default target the rank is too large for is refused, never left out in silence
    with pytest.raises(ConfigError, match=r"is one of the default targets: rank 64 is not "
                                          r"below .*; choose a rank below"):  # fmt: skip
        lora(shardplug.get_model("transformer").task("nnx"), 64)


def test_checkpoints_hold_the_adapters_alone_and_refuse_another_base(tmp_path):
    from shardplug.errors import CheckpointError

    task = lora(base(), RANK)
    run = task.trainer(strategy="fsdp", devices=2, precision="float32", checkpoint_dir=tmp_path)
    run.fit(iter(batches()), STEPS)  # saves its last step
    run.checkpoints.wait()
    meta = run.checkpoints.read_meta(STEPS)
    frozen = {"params/base/" + p for p in leaf_paths(run.state.params["base"])}
    assert set(meta["frozen"]) == frozen  # their fingerprints alone
    assert not any(n.startswith("params/base/") for n in meta["arrays"])
    again = task.trainer(strategy="tp", devices=2, precision="float32", checkpoint_dir=tmp_path)
    assert again.restore() == STEPS  # onto another layout, its base made as before
    for a, b in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(again.state.params),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    other = task.trainer(strategy="dp", devices=2, precision="float32", checkpoint_dir=tmp_path,
                         seed=1)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"holds adapters trained on another base: \d+ "
                       r"of its 15 frozen arrays differ \(params/base/"):  # fmt: skip
        other.restore()


def test_a_frozen_base_stays_frozen_whatever_the_optimizer():
    import optax

    adapter = LoraAdapter(base().adapter, RANK)  # no masked optimizer: adamw decays everything
    decaying = optax.adamw(1e-2, weight_decay=0.5)
    run = shardplug.Trainer(adapter, loss_fn=base().loss_fn, optimizer=decaying, strategy="dp",
                            devices=1, precision="float32")  # fmt: skip
    before = jax.tree.map(np.asarray, run.state.params)
    run.fit(iter(batches()), STEPS)
    for a, b in zip(jax.tree.leaves(before["base"]), jax.tree.leaves(run.state.params["base"]),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(before["lora"]["blocks.wi"]["r"],
                              run.state.params["lora"]["blocks.wi"]["r"])  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "adapter_config.json").write_text("{"), "not readable JSON"),
        (lambda d: (d / "adapter_config.json").write_text("[]"), "a list, not PEFT's adapter"),
        (lambda d: _edit(d, r="16"), "r is '16'; PEFT's rank is a positive integer"),
        (lambda d: _edit(d, lora_alpha=None), "lora_alpha is None; it takes a number"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{}"),
         "a damaged safetensors file"),
    ],
)
def test_damaged_adapters_are_one_line(tmp_path, capsys, damage, message):
    where = Path(shutil.copytree(PEFT, tmp_path / "adapters"))
    damage(where)
    assert main(["train", "--init-from", "tests/fixtures/hf/llama", "--lora-from", str(where),
                 "--steps", "1"]) == 2  # fmt: skip
    (line,) = said(capsys.readouterr().err)
    assert line.startswith("shardplug: error: ") and message in line, line


def _edit(where, **changes):
    raw = json.loads((where / "adapter_config.json").read_text())
    raw.update(changes)
    (where / "adapter_config.json").write_text(json.dumps(raw))
