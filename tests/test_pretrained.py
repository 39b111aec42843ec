"""Pretrained checkpoints (``shardplug.pretrained``): tiny random models of each family,
written by the reference implementation (``scripts/hf_fixtures.py``: Hugging Face
``transformers``), load into each framework and every layout and give the reference's
logits; they train, export back to the same tensors, and bad checkpoints are one line."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplug
from shardplug import pretrained
from shardplug.errors import PretrainedError
from shardplug.pretrained import families
from shardplug.pretrained.safetensors import Tensors

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
#: every registered family is tested: a new one needs its fixture (scripts/hf_fixtures.py)
FAMILIES = tuple(m.__name__.rpartition(".")[2] for m in families.MODULES)


def reference(family: str, rows: int = 1) -> dict[str, np.ndarray]:
    """The reference's batch, logits and loss; the batch tiled to ``rows`` x 2 rows."""
    ref = np.load(FIXTURES / family / "reference.npz")
    return {"tokens": np.tile(ref["tokens"], (rows, 1)),
            "ref": np.tile(ref["logits"], (rows, 1, 1)), "loss": float(ref["loss"])}  # fmt: skip


def logits_error(model, batch):
    """The logits' largest difference from the reference's, relative to its largest."""
    out = model(batch["tokens"])
    out = out[0] if isinstance(out, tuple) else out
    error = jnp.max(jnp.abs(out - batch["ref"])) / jnp.max(jnp.abs(batch["ref"]))
    return error, {}


def error_under(family, framework, strategy="dp", mesh=None, devices=None) -> float:
    """The logits' error, computed by the strategy's own compiled evaluation step."""
    model = pretrained.load(FIXTURES / family)
    trainer = shardplug.Trainer(model.adapter(framework), loss_fn=logits_error,
                                optimizer=optax.sgd(0.0), strategy=strategy, mesh=mesh,
                                devices=devices)  # fmt: skip
    batch = reference(family, rows=4)
    return trainer.evaluate([{"tokens": batch["tokens"], "ref": batch["ref"]}])["loss"]


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_device_gives_the_references_logits(family, framework):
    assert error_under(family, framework, devices=1) < 1e-5


@pytest.mark.parametrize(
    ("family", "framework", "strategy", "mesh"),
    [
        ("llama", "nnx", "dp", None),
        ("mistral", "linen", "fsdp", None),
        ("qwen2", "equinox", "tp", "model=8"),
        ("qwen3", "nnx", "fsdp+tp", "fsdp=4,model=2"),
        ("llama", "equinox", "fsdp+cp", "fsdp=2,context=4"),  # grouped-query heads, a ring
        ("qwen3", "linen", "pp+fsdp", "stage=2,fsdp=4"),
        ("gemma3", "linen", "fsdp+cp", "fsdp=2,context=4"),  # a sliding window: keys gathered
        ("gemma3", "equinox", "pp+fsdp", "stage=2,fsdp=4"),  # each stage its layers' kinds
        ("mixtral", "nnx", "dp+ep", "data=2,expert=4"),
        ("mixtral", "linen", "pp+fsdp", "stage=2,fsdp=4"),
        ("phi3", "linen", "fsdp+tp", "fsdp=4,model=2"),  # fused qkv_proj, gate_up_proj
        ("phi3", "equinox", "pp+fsdp", "stage=2,fsdp=4"),
    ],
)
def test_every_layout_gives_the_references_logits(family, framework, strategy, mesh):
    assert error_under(family, framework, strategy, mesh) < 1e-5


def test_each_device_reads_its_block_once_and_parameters_land_in_the_strategys_layout():
    model = pretrained.load(FIXTURES / "mistral")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), strategy="fsdp")  # fmt: skip
    stored = sum(model.tensors.array(n).nbytes for n in model.tensors.names())
    assert model.tensors.bytes_read == stored  # every byte once: a shared block is read once
    params = trainer.state.params
    placed = jax.tree.leaves(trainer.param_shardings)
    assert [a.sharding for a in jax.tree.leaves(params)] == placed
    assert params["layers"]["q"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    files = Tensors(FIXTURES / "mistral")
    q0 = files.read("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_array_equal(np.asarray(params["layers"]["q"][0]), q0.T)


def test_first_step_loss_is_the_references_and_fine_tuning_lowers_it():
    model = pretrained.load(FIXTURES / "mixtral")
    trainer = shardplug.Trainer(model.adapter("equinox"), loss_fn=model.loss_fn,
                                optimizer=optax.adamw(3e-3), strategy="dp+ep",
                                mesh="data=2,expert=4")  # fmt: skip
    batch = {"tokens": reference("mixtral", rows=4)["tokens"]}
    history = trainer.fit(iter([batch] * 6), steps=6)
    first = history[0]["lm_loss"]
    assert abs(first - reference("mixtral")["loss"]) < 1e-5 * reference("mixtral")["loss"]
    assert history[-1]["lm_loss"] < first - 0.5


@pytest.mark.parametrize("family", ["llama", "phi3"])  # phi3: fused tensors made back whole
def test_export_writes_the_familys_tensors_back_byte_for_byte(tmp_path, family):
    model = pretrained.load(FIXTURES / family)
    trainer = shardplug.Trainer(model.adapter("linen"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), strategy="fsdp+tp",
                                mesh="fsdp=4,model=2")  # fmt: skip
    out = pretrained.export(trainer.state.params, model, tmp_path / "out")
    original, written = Tensors(FIXTURES / family), Tensors(out)
    assert written.names() == original.names()
    for name in original.names():
        assert written.array(name).tobytes() == original.array(name).tobytes(), name
    again = pretrained.load(out)
    assert again.config == model.config  # the config round-trips (tensors in one file now)


def test_an_export_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    import shardplug.pretrained as module

    model = pretrained.load(FIXTURES / "qwen2")

    def full_disk(path, entries):
        pathlib.Path(path).write_bytes(b"part")
        raise OSError(28, "No space left on device")

    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), devices=1)  # fmt: skip
    monkeypatch.setattr(module, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        pretrained.export(trainer.state.params, model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # written whole or not at all


def test_an_export_under_a_config_of_other_shapes_is_one_line(tmp_path, capsys):
    """A run exported with a config that says 3 layers where it trained 2: refused before a
    byte is written, naming the parameter (an IndexError before)."""
    from shardplug.cli import main

    assert main(["train", "--init-from", str(FIXTURES / "llama"), "--steps", "1", "--devices",
                 "1", "--checkpoint-dir", str(tmp_path / "ck")]) == 0  # fmt: skip
    other = tmp_path / "three"
    shutil.copytree(FIXTURES / "llama", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    capsys.readouterr()
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out",
                 str(tmp_path / "out"), "--format", "hf", "--init-from", str(other)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "has shape (2, 32), where the llama config implies (3, 32)" in line
    assert not (tmp_path / "out").exists()
    # the same shapes under another architecture's name: refused, not relabelled
    relabelled = {**config, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    relabelled.pop("rope_scaling")
    (other / "config.json").write_text(json.dumps(relabelled))
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out",
                 str(tmp_path / "out"), "--format", "hf", "--init-from", str(other)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is a mistral checkpoint, and the run started from" in line and "a llama" in line
    assert not (tmp_path / "out").exists()


def test_every_registered_family_has_a_fixture_and_a_recipe_to_make_it():
    """A family added to the registry is in these tests (FAMILIES above) and in the fixture
    script, which writes a fixture for each (its table read here without transformers)."""
    import ast

    script = pathlib.Path(__file__).parent.parent / "scripts" / "hf_fixtures.py"
    tree = ast.parse(script.read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "RECIPES")  # fmt: skip
    assert {k.value for k in table.keys} == set(FAMILIES) and len(FAMILIES) >= 7
    for family in FAMILIES:
        assert (FIXTURES / family / "config.json").is_file(), family


def test_configs_as_transformers_4_and_5_write_them_read_the_same(tmp_path):
    raw = json.loads((FIXTURES / "llama" / "config.json").read_text())  # 4.x: rope_scaling
    five = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    five["rope_parameters"] = {**raw["rope_scaling"], "rope_theta": raw["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(five))
    old, new = pretrained.read_config(FIXTURES / "llama"), pretrained.read_config(tmp_path)
    assert old == new and old.rope["rope_type"] == "llama3" and old.rope_theta == 500000.0
    scaled = old.inverse_frequencies()
    plain = [1 / 500000.0 ** (i / 8) for i in range(0, 8, 2)]
    assert scaled[-1] == pytest.approx(plain[-1] / 8)  # a long wavelength: divided by factor
    assert plain[0] / 8 < scaled[0] < plain[0]  # 2 pi against 16 positions: the smooth band

    raw = json.loads((FIXTURES / "gemma3" / "config.json").read_text())  # 5.x: by layer type
    four = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    four.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=2,
                rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(four))
    old, new = pretrained.read_config(tmp_path), pretrained.read_config(FIXTURES / "gemma3")
    assert old == new and new.layer_types == ("sliding", "full")
    assert new.inverse_frequencies(local=True)[1] == pytest.approx(1 / 10000.0 ** (2 / 16))
    assert new.inverse_frequencies()[1] == pytest.approx(1 / 1e6 ** (2 / 16) / 8)


def test_a_fused_tensor_is_several_parameters_each_read_from_its_rows():
    """Phi-3 stores q, k and v as one qkv_proj and gate and up as one gate_up_proj; each
    device reads only its block of its parameter's rows; a partial rotary reads as 4.x wrote
    it too, and LongRoPE is refused."""
    model = pretrained.load(FIXTURES / "phi3")
    assert model.config.rotary_dim == 4 and model.config.head_dim == 8
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), strategy="fsdp+tp",
                                mesh="fsdp=4,model=2")  # fmt: skip
    stored = sum(model.tensors.array(n).nbytes for n in model.tensors.names())
    assert model.tensors.bytes_read == stored  # each fused tensor's bytes once, over its parts
    params, files = trainer.state.params["layers"], Tensors(FIXTURES / "phi3")
    qkv = files.read("model.layers.1.self_attn.qkv_proj.weight")
    gate_up = files.read("model.layers.1.mlp.gate_up_proj.weight")
    for name, rows in (("q", qkv[:32]), ("k", qkv[32:48]), ("v", qkv[48:]),
                       ("gate", gate_up[:64]), ("up", gate_up[64:])):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(params[name][1]), rows.T, err_msg=name)


def test_phi3_configs_as_transformers_4_and_5_write_them_read_the_same(tmp_path):
    raw = json.loads((FIXTURES / "phi3" / "config.json").read_text())
    four = {k: v for k, v in raw.items() if k != "rope_parameters"}
    four.update(rope_theta=10000.0, partial_rotary_factor=0.5, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(four))
    assert pretrained.read_config(tmp_path) == pretrained.read_config(FIXTURES / "phi3")
    four["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 2,
                            "long_factor": [2.0] * 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(four))
    with pytest.raises(PretrainedError, match="rotary scaling 'longrope' is not supported"):
        pretrained.read_config(tmp_path)


def _copy(tmp_path, family="qwen2") -> pathlib.Path:
    return pathlib.Path(shutil.copytree(FIXTURES / family, tmp_path / family))


def _config(where: pathlib.Path, **changes) -> None:
    raw = json.loads((where / "config.json").read_text())
    raw.update(changes)
    (where / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "no config.json there"),
        (
            lambda d: _config(d, model_type="gpt2"),
            "architecture 'gpt2' is not supported; supported: llama",
        ),
        (
            lambda d: _config(d, intermediate_size=48),
            "tensor model.layers.0.mlp.gate_proj.weight "
            "has shape (64, 32), but config.json implies (48, 32)",
        ),
        (
            lambda d: (d / "model-00002-of-00003.safetensors").unlink(),
            "a shard model.safetensors.index.json names is missing",
        ),
        (
            lambda d: _config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "rotary scaling 'yarn' is not supported",
        ),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "a list, not a model's config"),
        (lambda d: _config(d, hidden_size="64"), "hidden_size is '64'; it takes a positive"),
        (lambda d: _config(d, num_key_value_heads=0), "num_key_value_heads is 0; it takes a"),
        (lambda d: _config(d, rms_norm_eps="tiny"), "rms_norm_eps is 'tiny'; it takes a number"),
        (lambda d: _config(d, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                           rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         "rope_parameters (default) and rope_scaling (yarn) disagree"),
    ],
)
def test_a_bad_checkpoint_is_one_line(tmp_path, damage, message):
    where = _copy(tmp_path, "llama" if "shard" in message else "qwen2")
    damage(where)
    with pytest.raises(PretrainedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pretrained.load(where)


def test_a_dtype_it_cannot_cast_to_is_refused_and_bfloat16_is_kept_as_asked():
    with pytest.raises(PretrainedError, match="cannot cast the parameters to int8"):
        pretrained.load(FIXTURES / "qwen2", dtype="int8")
    assert pretrained.load(FIXTURES / "qwen2", dtype="bfloat16").dtype == jnp.bfloat16


def test_the_command_line_fine_tunes_exports_and_refuses_shape_flags(capsys, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    from shardplug.cli import main
    from shardplug.running.checkpoint import Checkpoints

    reads, read = [], Checkpoints.read_arrays

    def counted(self, step=None, names=None):
        reads.append(names)
        return read(self, step, names)

    monkeypatch.setattr(Checkpoints, "read_arrays", counted)

    runs, out = tmp_path / "runs", tmp_path / "hf"
    assert main(["train", "--init-from", str(FIXTURES / "qwen3"), "--strategy", "fsdp",
                 "--steps", "3", "--batch-size", "8", "--checkpoint-dir", str(runs),
                 "--checkpoint-every", "3"]) == 0  # fmt: skip
    assert "trained qwen3:qwen3 (nnx) with fsdp" in capsys.readouterr().out
    assert main(["export", "--checkpoint-dir", str(runs), "--out", str(out), "--format", "hf"]) == 0
    assert "as a qwen3 checkpoint" in capsys.readouterr().out
    # one parameter a read, the optimizer's state never
    assert all(len(names) == 1 and names[0].startswith("params/") for names in reads), reads
    assert len(reads) == len(pretrained.parameters(pretrained.read_config(FIXTURES / "qwen3")))
    trained, original = Tensors(out), Tensors(FIXTURES / "qwen3")
    assert trained.names() == original.names()
    moved = [n for n in original.names() if not np.array_equal(trained.read(n), original.read(n))]
    assert moved  # three steps of AdamW changed the weights, and they were written
    assert main(["export", "--checkpoint-dir", str(runs), "--out", str(out), "--format", "hf"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["train", "--init-from", str(FIXTURES / "qwen3"), "--layers", "4"]) == 2
    assert "--layers shape the reference model; --init-from" in capsys.readouterr().err


def _text_reference(rows):
    """The reference's loss on the fixture text's packed rows ``rows`` (each found by its
    tokens among every row the reference packed)."""
    ref = np.load(FIXTURES / "llama" / "text_reference.npz")
    index = [int(np.flatnonzero((ref["tokens"] == r).all(1))[0]) for r in rows["tokens"]]
    np.testing.assert_array_equal(rows["loss_mask"], ref["loss_mask"][index])
    return float(ref["loss_sum"][index].sum() / ref["counted"][index].sum())


def test_fine_tuning_on_text_starts_at_the_references_loss_on_the_same_tokens():
    model = pretrained.load(FIXTURES / "llama")
    task = model.task("nnx", text=str(FIXTURES / "text"), sequence=24, batch_size=4, seed=3)
    trainer = task.trainer(strategy="fsdp", devices=4)
    first = next(iter(task.batches()))  # shuffled rows: the reference's are found by their tokens
    history = trainer.fit(task.batches(), steps=1)
    want = _text_reference(first)
    assert abs(history[0]["lm_loss"] - want) < 1e-5 * want
    ref = np.load(FIXTURES / "llama" / "text_reference.npz")
    assert ref["loss_mask"].sum() < ref["loss_mask"].size  # boundaries fall inside rows


def test_the_command_line_fine_tunes_on_text_and_resumes_at_its_data_position(capsys, tmp_path):
    from shardplug.cli import main

    def train(runs, steps, *more):
        metrics = tmp_path / f"{runs}.jsonl"
        argv = ["train", "--init-from", str(FIXTURES / "llama"), "--data",
                f"text:{FIXTURES / 'text'}/*", "--sequence", "24", "--batch-size", "4",
                "--strategy", "fsdp", "--devices", "4", "--steps", str(steps), "--checkpoint-dir",
                str(tmp_path / runs), "--checkpoint-every", "2", "--metrics-out", str(metrics),
                "--quiet", *more]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        return [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]

    straight = train("run", 4)
    shutil.rmtree(tmp_path / "run" / "4")  # as if the run had been stopped after step 2
    resumed = train("run", 4, "--resume")
    assert resumed == pytest.approx(straight, rel=1e-6)  # the same rows, in the same order
    assert len(set(straight)) == 4


def test_text_that_cannot_be_used_is_one_line(tmp_path, capsys):
    import tokenizers
    from tokenizers import models

    from shardplug.cli import main

    model = pretrained.load(FIXTURES / "llama")
    wide = tmp_path / "wide"
    wide.mkdir()
    vocab = {f"w{i}": i for i in range(200)}  # more tokens than the model's 96
    tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(wide / "tokenizer.json"))
    cases = [
        (dict(tokenizer=wide), "the tokenizer has 200 tokens but the model's vocabulary is 96"),
        (dict(tokenizer=tmp_path), "no tokenizer there; give --tokenizer DIR"),
        (dict(text=str(tmp_path / "none*.txt")), "no files there"),
        (dict(sequence=4096), "fewer than one row of 4097"),
    ]
    for given, message in cases:
        options = {"text": str(FIXTURES / "text"), "sequence": 24, **given}
        with pytest.raises(PretrainedError, match=message):
            model.task(batch_size=2, **options)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(PretrainedError, match=r"bad.jsonl:2: each line of a .jsonl file"):
        model.task(batch_size=2, text=str(bad), sequence=4)
    for lines, message in [('{"text": 42}\n', 'bad.jsonl:1: its "text" is 42; a document'),
                           ('{"text": null}\n', 'its "text" is None'),
                           ("\n\n  \n", "no text in its files")]:  # fmt: skip
        bad.write_text(lines)
        with pytest.raises(PretrainedError, match=message):
            model.task(batch_size=2, text=str(bad), sequence=4)
    for argv, message in [
        (["--data", "text:x.txt"], "--data text:... fine-tunes a pretrained checkpoint"),
        (["--init-from", str(FIXTURES / "llama"), "--data", "x.txt"], "give text:FILE_OR_GLOB"),
        (["--init-from", str(FIXTURES / "llama"), "--tokenizer", "t"], "give the text too"),
    ]:
        assert main(["train", *argv]) == 2
        assert message in capsys.readouterr().err


def test_bfloat16_weights_train_under_a_pipeline_on_cpu():
    """XLA's CPU compiler aborted the process on the pipeline's 16-bit sums in shard_map;
    they go in float32 there (exact: one stage holds the value, the rest zeros)."""
    model = pretrained.load(FIXTURES / "llama", dtype="bfloat16")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), strategy="pp+fsdp",
                                mesh="stage=2,fsdp=4")  # fmt: skip
    assert trainer.state.params["layers"]["q"].dtype == jnp.bfloat16
    history = trainer.fit(iter([{"tokens": reference("llama", rows=4)["tokens"]}] * 2), steps=2)
    want = reference("llama")["loss"]
    assert abs(history[0]["lm_loss"] - want) < 2e-2 * want  # bf16 weights and activations


def test_float16_parameters_on_cpu_are_one_line(capsys):
    from shardplug.cli import main

    assert main(["train", "--init-from", str(FIXTURES / "qwen2"), "--param-dtype", "float16",
                 "--steps", "1", "--devices", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "XLA:CPU has no float16 matrix product" in err[0], err
