"""The command line: listing, the acceptance run, and one clear line for every bad input."""

import json
import subprocess
import sys

import numpy as np
import optax
import pytest

import shardplug
from shardplug.cli import main

STRATEGIES = ["dp", "fsdp", "2d", "pmap"]


def test_strategies_json_lists_the_builtins(capsys):
    assert main(["strategies", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(STRATEGIES) <= rows.keys()
    for name in STRATEGIES:
        assert rows[name]["source"] == "built-in"
        assert rows[name]["description"]
    assert rows["fsdp"]["options"] == {
        "min_size": "1024",
        "prefer": "('embed', 'mlp', 'heads', 'vocab')",
    }
    assert (rows["fsdp"]["kind"], rows["fsdp"]["composes"]) == ("parallelism", True)
    assert (rows["pmap"]["kind"], rows["pmap"]["composes"]) == ("strategy", False)
    assert (rows["2d"]["kind"], rows["2d"]["parts"]) == ("composition", "dp+tp")


def test_env_and_version_name_what_a_bug_report_needs(capsys):
    import importlib.metadata

    import jax

    assert main(["env", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    for name in ("jax", "jaxlib", "flax", "equinox", "optax", "orbax-checkpoint", "qwix"):
        assert found[name] == importlib.metadata.version(name)
    assert found["jax"] == jax.__version__
    assert found["devices"] == f"{len(jax.devices())} cpu (cpu)"
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["shardplug", found["shardplug"]]
    assert ["jax", jax.__version__] in [line.split() for line in lines]  # aligned: any width


def test_strategies_table(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in STRATEGIES) and "built-in" in out


def test_every_strategy_trains_the_mlp_to_the_same_loss(tmp_path, capsys):
    finals = {}
    for strategy in STRATEGIES:
        out = tmp_path / f"{strategy}.jsonl"
        argv = [
            "train",
            "--strategy",
            strategy,
            "--model",
            "mlp",
            "--adapter",
            "nnx",
            "--devices",
            "8",
            "--steps",
            "30",
            "--seed",
            "0",
            "--metrics-out",
            str(out),
            "--quiet",
        ]
        assert main(argv) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(30))
        assert all({"loss", "step_time", "samples_per_sec"} <= r.keys() for r in rows)
        assert rows[-1]["loss"] < 0.1 * rows[0]["loss"]
        finals[strategy] = rows[-1]["loss"]
        summary = capsys.readouterr().out.strip().splitlines()
        assert len(summary) == 1 and summary[0].startswith(
            f"shardplug: trained mlp (nnx) with {strategy}"
        )
    np.testing.assert_allclose(list(finals.values()), finals["dp"], rtol=1e-4)


def test_strategy_options_reach_the_plugin(tmp_path, capsys):
    argv = [
        "train",
        "--strategy",
        "fsdp",
        "-o",
        "min_size=0",
        "-o",
        "prefer=mlp,embed",
        "--model",
        "mlp",
        "--steps",
        "2",
        "--quiet",
    ]
    assert main(argv) == 0
    assert "with fsdp on 8 cpu devices (fsdp=8, auto axes)" in capsys.readouterr().out


BAD = [
    (
        ["--strategy", "zero3"],
        "unknown strategy 'zero3'; available: 2d, cp, dp, ep, fsdp, pmap, pp",
    ),
    (["--mesh", "data=3"], "mesh data=3 has 3 devices but the run has 8"),
    (["--strategy", "2d", "--mesh", "data=4,model=4"], "has 16 devices but the run has 8"),
    (["--strategy", "pmap", "--mesh", "model=8"], "give sizes for exactly ['data']"),
    (["--mesh", "data:8"], "malformed mesh 'data:8'"),
    (["--steps", "0"], "argument --steps: must be positive, got 0"),
    (["--steps", "ten"], "argument --steps: 'ten' is not a int"),
    (["--batch-size", "30"], "30 rows in dimension 0, which do not split over the 8 devices"),
    (["--strategy", "fsdp", "-o", "threshold=3"], "has no option 'threshold'"),
    (["--strategy", "fsdp", "-o", "min_size=big"], "option min_size='big' is not a valid int"),
    (["--strategy", "fsdp", "-o", "min_size"], "is not KEY=VALUE"),
    (["--strategy", "fsdp+cp", "-o", "cp.scheme="], "option cp.scheme= has no value: give one"),
    (["--model", "resnet"], "unknown model 'resnet'; available: classifier, cnn, mlp, transformer"),
    (["--adapter", "keras"], "unknown adapter 'keras'; available: nnx, linen, equinox"),
    (["--devices", "0"], "argument --devices: must be positive, got 0"),
    (["--devices", "100000"], "100000 devices: shardplug simulates at most 4096 CPU devices"),
    (
        ["--steps", "5", "--profile", "prof", "--profile-steps", "100:200"],
        "--profile-steps 100:200: this run trains steps 0 to 4, so no trace would be written",
    ),
    (["--addon", "grad-fp8"], "unknown add-on 'grad-fp8'; available:"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("earlier run\n")
    argv = ["train", "--model", "mlp", "--quiet", "--metrics-out", str(metrics), *args]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shardplug: error: ") and message in lines[0]
    assert metrics.read_text() == "earlier run\n"  # nothing already written is lost


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "zero3"], "shardplug: error: unknown strategy 'zero3'; available:"),
        (["--strategy", "2d", "--mesh", "data=3,model=2"], "shardplug: error: mesh data=3,model=2"),
    ],
)
def test_real_process_exits_2_without_traceback(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "shardplug", "train", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("adapter", ["linen", "equinox"])
def test_every_adapter_trains_from_the_command_line(adapter, tmp_path, capsys):
    out = tmp_path / "m.jsonl"
    argv = [
        "train",
        "--adapter",
        adapter,
        "--model",
        "cnn",
        "--strategy",
        "pmap",
        "--steps",
        "20",
        "--metrics-out",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20 and rows[-1]["loss"] < rows[0]["loss"]
    assert {"accuracy", "step_time"} <= rows[0].keys()
    assert f"trained cnn ({adapter}) with pmap" in capsys.readouterr().out


def test_a_step_that_cannot_fit_is_refused_before_anything_is_allocated(
    tmp_path, capsys, monkeypatch
):
    """On simulated CPU devices every device's peak comes out of the host's memory: a step
    needing more than the host has is one line, not a run the kernel kills."""
    from shardplug.cli import watch
    from shardplug.trainer import Trainer

    made = []
    allocate = Trainer.allocate
    monkeypatch.setattr(Trainer, "allocate", lambda self: made.append(1) or allocate(self))
    monkeypatch.setattr(watch, "host_available", lambda: 10**5)  # a host with 100 kB free
    argv = ["train", "--model", "mlp", "--steps", "1", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardplug: error: the step needs ") and len(err.splitlines()) == 1
    assert "of the host's 100.0 kB available (8 simulated CPU devices x " in err
    assert made == []  # refused before the state was made
    assert main([*argv, "--skip-memory-check"]) == 0 and made == [1]


def test_the_losses_are_drawn_from_a_run_and_from_its_metrics(tmp_path, capsys):
    metrics, png, again = tmp_path / "m.jsonl", tmp_path / "loss.png", tmp_path / "m.png"
    assert main(["train", "--model", "mlp", "--steps", "4", "--quiet", "--metrics-out",
                 str(metrics), "--plot", str(png)]) == 0  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"drew the losses in {png}" in capsys.readouterr().out
    assert main(["plot", str(metrics)]) == 0 and again.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "loss": 1.0}\nnot json\n')
    (tmp_path / "text.jsonl").write_text('{"step": 0, "loss": "4.1"}\n')
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    named_png = tmp_path / "metrics.png"  # the metrics, named as a picture
    named_png.write_bytes(metrics.read_bytes())
    kept = {p: p.read_bytes() for p in (metrics, named_png)}
    for argv, message in [
        (["plot", str(tmp_path / "none.jsonl")], "no such file; give the JSON lines"),
        (["plot", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON line"),
        (["plot", str(tmp_path / "text.jsonl")], "row 1: its loss is '4.1'; train"),
        (["plot", str(tmp_path / "list.jsonl")], "row 1 is not an object"),
        (["plot", str(named_png)], "is the file this command reads, which it never writes"),
        (["plot", str(metrics), "--out", str(metrics)], "a picture is drawn as .png"),
        (["train", "--model", "mlp", "--plot", str(tmp_path)], "is a folder: name the .png"),
        (["train", "--model", "mlp", "--plot", "loss.xyz"], "--plot loss.xyz: a picture is"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in kept} == kept  # nothing the user gave was written


def test_recommend_compares_strategies_of_its_own_and_takes_no_strategy_option(capsys):
    for flags in (["--strategy", "fsdp"], ["-o", "min_size=0"]):
        assert main(["recommend", *flags, "--device-memory", "1GB"]) == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_a_flag_of_another_command_is_said_to_be_its(capsys):
    """train takes no --target (it runs on the devices here): the commands that do are named,
    and the help pointed to is the command's own; a flag no command takes is just unknown."""
    assert main(["train", "--target", "h100"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("shardplug: error: unrecognized arguments: --target h100: train takes no "
                    "--target; explain, recommend and bench take it (see shardplug train --help)")
    assert main(["explain", "--restarts=2"]) == 2
    assert "explain takes no --restarts; launch takes it" in capsys.readouterr().err
    assert main(["train", "--bogus", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shardplug: error: unrecognized arguments: --bogus 3 (see shardplug train --help)")


def test_a_resume_reads_the_run_the_checkpoint_holds():
    from pathlib import Path

    from shardplug.cli.config import RunConfig
    from shardplug.cli.resume import resumed
    from shardplug.errors import ConfigError

    old = resumed(RunConfig(), {"task": "shardplug.tasks:digits", "seed": 3})  # before the rename
    assert (old.task, old.seed) == ("shardplug.builtin_tasks:digits", 3)
    with pytest.raises(ConfigError, match=r"--init-from ckpt: the run in c trained --task "
                                          r"t\.py:task, and a resumed run keeps the model"):
        resumed(RunConfig(init_from="ckpt", checkpoint_dir=Path("c")), {"task": "t.py:task"})


@pytest.mark.parametrize("size", ["1e309", "1e400GB", "1.2.3GB", "0", "-5GB", "80XB"])
def test_a_device_memory_that_is_not_a_size_is_one_line(size, capsys):
    assert main(["recommend", "--model", "mlp", f"--device-memory={size}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("shardplug: error: argument --device-memory: expected a ")


def test_a_path_that_cannot_be_used_is_one_line(tmp_path, capsys):
    """An OSError about a path the command was given (a file where a folder is needed, a
    folder it cannot read or write) is the user's to fix: one line, exit 2."""
    ck = tmp_path / "ck"
    assert main(["train", "--model", "mlp", "--steps", "1", "--quiet",
                 "--checkpoint-dir", str(ck)]) == 0  # fmt: skip
    (tmp_path / "afile").write_text("mine")
    capsys.readouterr()
    assert main(["export", "--checkpoint-dir", str(ck), "--out",
                 str(tmp_path / "afile" / "w.npz")]) == 2  # fmt: skip
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"shardplug: error: {tmp_path / 'afile'}: a file, where a folder is needed; "
                    "check the path and its permissions")  # fmt: skip
    assert (tmp_path / "afile").read_text() == "mine"


def test_each_setting_is_declared_once_and_reaches_the_trainer_by_its_name():
    """A run's flag, help, check and resume rule come from its one declaration: the parser
    takes every declared flag to its field, the resume rules are read from the tags, and
    each setting marked for the Trainer is one of its keywords, given by ``trainer_for``
    (``--flops-per-sample``, added that way)."""
    import dataclasses
    import inspect

    from shardplug.cli.config import RunConfig, trainer_for
    from shardplug.cli.parser import build_parser
    from shardplug.cli.settings import KNOBS, LORA, RESUMED, SHAPING, TRAINER, declared
    from shardplug.settings import Settings

    parser = build_parser()
    for field in declared():  # a flag's text parses to its field, under every command
        flag, meta = field.metadata["flags"][-1], field.metadata["argparse"]
        kind = getattr(meta.get("type"), "__name__", "")
        text = {"step_range": "1:4", "probability": "0.5"}.get(kind, "7")
        text = meta["choices"][-1] if "choices" in meta else text
        args = [flag] if meta.get("action") == "store_true" else [flag, text]
        config = RunConfig.of(parser.parse_args(["train", *args]))
        assert getattr(config, field.name) not in (None, (), field.default), flag
    assert set(SHAPING) <= set(RESUMED) and set(KNOBS) | set(LORA) <= set(RESUMED)
    # a flag's default is its command's: explain takes no --steps (a schedule ends where
    # its warmup says), train's is 100
    assert RunConfig.of(parser.parse_args(["explain"])).steps is None
    assert RunConfig.of(parser.parse_args(["train"])).steps == 100
    keywords = {f.name for f in dataclasses.fields(Settings)}
    keywords |= set(inspect.signature(shardplug.Trainer).parameters)
    assert set(TRAINER) <= keywords, set(TRAINER) - keywords
    config = RunConfig.of(parser.parse_args(["train", "--model", "mlp", "--seed", "4",
                                             "--flops-per-sample", "2.5e6", "--log-every",
                                             "3"]))  # fmt: skip
    model = shardplug.get_model("mlp")
    task = shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.sgd(0.1), data=())
    trainer = trainer_for(config, task, "dp", allocate=False, devices=1)
    assert trainer.flops_per_sample == 2.5e6 and trainer.settings.seed == 4
    assert trainer.settings.log_every == 3 and trainer.settings.config["seed"] == 4


def test_the_trainer_takes_its_settings_as_one_value_or_by_name():
    from shardplug.settings import Settings

    model = shardplug.get_model("mlp")
    task = shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.sgd(0.1), data=())
    trainer = task.trainer(devices=1, allocate=False, settings=Settings(seed=3, keep=5),
                           keep=2)  # fmt: skip
    assert (trainer.settings.seed, trainer.settings.keep) == (3, 2)
    assert trainer.precision == "float32"  # "auto" chose for the CPU
    assert task.trainer(devices=1, allocate=False, config=None).config == {}
    with pytest.raises(shardplug.errors.ConfigError, match="Trainer takes no keyword 'sed'"):
        task.trainer(devices=1, allocate=False, sed=3)
