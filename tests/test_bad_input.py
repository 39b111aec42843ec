"""Answers that used to mislead: each is now one line that says what happened."""

import json
import pathlib
import types

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardplug.cli import main

TASKS = """
import numpy as np, optax, shardplug

model = shardplug.get_model("mlp")

def loss_says(value):
    def loss_fn(m, batch):
        out = model.loss_fn(m, batch)
        return value(out[0] if isinstance(out, tuple) else out)
    return shardplug.Task(model.adapter("nnx"), loss_fn, optax.adam(1e-3),
                          data=lambda: model.batches(64, 0))

def text_loss():
    return loss_says(lambda loss: "low")

def vector_metric():
    return loss_says(lambda loss: (loss, {"per_row": np.ones(3)}))

def vector_loss():
    def loss_fn(m, batch):
        out = model.loss_fn(m, batch)
        loss = out[0] if isinstance(out, tuple) else out
        return loss * np.ones(2, np.float32)
    return shardplug.Task(model.adapter("nnx"), loss_fn, optax.adam(1e-3),
                          data=lambda: model.batches(64, 0))

def empty():
    return shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3), data=[])

def nan_sometimes():
    def data():
        for i, batch in enumerate(model.batches(64, 0)):
            if i in (1, 3):
                batch = dict(batch, x=np.full_like(batch["x"], np.nan))
            yield batch
    return shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3), data=data)
"""


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text(TASKS)
    return path


def one_line(capsys) -> str:
    """The last line of stderr (a warning may come before it), with no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--seed", "-1"], "argument --seed: must be from 0 to 4294967295, got -1"),
        (["--lr", "nan"], "argument --lr: must be a finite number, got nan"),
        (
            ["--task", "{tasks}:text_loss"],
            "loss_fn must return the loss as a scalar array computed from the model, got str",
        ),
        (["--task", "{tasks}:vector_metric"], "metric 'per_row' has shape (3,): metrics must be"),
        (["--task", "{tasks}:empty"], "task empty: its data gave no batch, so nothing was trained"),
    ],
)
def test_bad_input_is_one_line(args, says, tasks, capsys):
    args = [a.format(tasks=tasks) for a in args]
    assert main(["train", "--steps", "3", "--devices", "2", "--quiet", *args]) == 2
    line = one_line(capsys)
    assert line.startswith("shardplug: error: ") and says in line, line


def test_resume_names_the_checkpoint_s_model(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    assert main(["train", "--steps", "1", "--devices", "2", "--quiet", "--layers", "1",
                 "--checkpoint-dir", ckpt]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--resume", "--model", "mlp", "--checkpoint-dir", ckpt]) == 2
    assert one_line(capsys) == (
        f"shardplug: error: --checkpoint-dir {ckpt} holds a run of transformer, not of --model "
        "mlp: drop --model to resume it, or choose an empty directory"
    )


def test_skipped_steps_are_counted_and_the_metrics_are_strict_json(tasks, tmp_path, capsys):
    out = tmp_path / "m.jsonl"
    assert main(["train", "--task", f"{tasks}:nan_sometimes", "--steps", "5", "--devices", "2",
                 "--quiet", "--on-nonfinite", "skip", "--log-every", "1",
                 "--metrics-out", str(out)]) == 0  # fmt: skip
    summary = capsys.readouterr().out
    assert "skipped 2 of 5 steps whose loss or gradient was not finite" in summary

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in out.read_text().splitlines()]
    assert [r["loss"] is None for r in rows] == [False, True, False, True, False]
    assert [r["skipped"] for r in rows] == [0, 1, 0, 1, 0]


def _api_misuse(case):
    import jax.numpy as jnp
    import optax

    import shardplug

    model = shardplug.get_model("mlp")

    def trainer(loss_fn=model.loss_fn, **kwargs):
        return shardplug.Trainer(model.adapter("nnx"), loss_fn=loss_fn,
                                 optimizer=optax.sgd(0.1), devices=2, **kwargs)  # fmt: skip

    return {
        "strategy=3": lambda: trainer(strategy=3),
        "strategy=[]": lambda: trainer(strategy=[]),
        "strategy=class": lambda: trainer(strategy=shardplug.Trainer),
        "mesh of strings": lambda: trainer(mesh={"data": "2"}),
        "fit(42)": lambda: trainer().fit(42, 1),
        "fit([None, None])": lambda: trainer().fit([None, None], 2),
        "a loss of one argument": lambda: trainer(loss_fn=lambda m: 0.0).fit(model.batches(8), 1),
        "a loss that is not a function": lambda: trainer(loss_fn=3).fit(model.batches(8), 1),
        "a constant loss": lambda: trainer(loss_fn=lambda m, b: 1.0).fit(model.batches(8), 1),
        "an integer loss": lambda: trainer(
            loss_fn=lambda m, b: jnp.argmax(model.loss_fn(m, b)[0] * jnp.ones(2))
        ).fit(model.batches(8), 1),
        "a Mean counted by a word": lambda: trainer(
            loss_fn=lambda m, b: shardplug.Mean(model.loss_fn(m, b)[0], "rows")
        ).fit(model.batches(8), 1),
        "a Mean counted by None": lambda: trainer(
            loss_fn=lambda m, b: shardplug.Mean(model.loss_fn(m, b)[0], None)
        ).fit(model.batches(8), 1),
        "pretrained.load(None)": lambda: shardplug.pretrained.load(None),
    }[case]


@pytest.mark.parametrize(
    ("case", "message"),
    [("strategy=3", "strategy=3: give a strategy's name"),
     ("strategy=[]", r"strategy=\[\]: give a strategy's name"),
     ("strategy=class", "give a strategy's name"),
     ("mesh of strings", "mesh={'data': '2'}: give 'data=2,model=4' or a dict"),
     ("fit(42)", r"fit\(batches=42\): give an iterable of batches"),
     ("fit([None, None])", "the first batch is None: a batch is a pytree of arrays"),
     ("a loss of one argument", r"cannot be called as loss_fn\(model, batch\)"),
     ("a loss that is not a function", r"loss_fn must be a function"),
     ("a constant loss", r"computed from the model, got the Python number 1.0"),
     ("an integer loss", "must return a floating-point loss, got int32"),
     ("a Mean counted by a word", "the loss is a shardplug.Mean whose count is 'rows'"),
     ("a Mean counted by None", "the loss is a shardplug.Mean whose count is None"),
     ("pretrained.load(None)", r"pretrained.load\(None\): give the checkpoint's directory")],
)  # fmt: skip
def test_the_python_apis_misuses_are_config_errors_naming_the_argument(case, message):
    from shardplug.errors import ShardplugError

    with pytest.raises(ShardplugError, match=message) as caught:
        _api_misuse(case)()
    assert "\n" not in str(caught.value)


def test_recommend_of_a_task_every_strategy_refuses_says_the_tasks_fault(tasks, capsys):
    argv = ["recommend", "--task", f"{tasks}:vector_loss", "--device-memory", "80GB",
            "--strategies", "dp,fsdp"]  # fmt: skip
    assert main(argv) == 2  # not "no strategy fits ... add devices", exit 0
    assert one_line(capsys) == (
        "shardplug: error: recommend: every strategy was refused this task (2); dp: loss_fn "
        "must return a scalar loss, got shape (2,): average it"
    )


def test_what_is_right_is_still_taken():
    """The checks above refuse no valid input: numpy's integers as mesh sizes, an empty
    value for an option that takes text or a list."""
    import numpy as np
    import optax

    import shardplug
    from shardplug.core.registry import strategy_options

    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.1), devices=2,
                                mesh={"data": np.int64(2)}, allocate=False)  # fmt: skip
    assert dict(trainer.mesh.shape) == {"data": 2}
    prefer = next(o for o in strategy_options("fsdp") if o.name == "prefer")
    assert prefer.parse("") == ()


# -- the fourth sweep --------------------------------------------------------------------------


def test_a_plain_resume_runs_where_its_checkpoint_ran(tmp_path, capsys):
    """A run on 4 devices with a batch of 4, resumed with no --devices, resumes on 4 (not
    refused over 8); --devices 8 is one line naming the 4 and the batch size's trade."""
    ckpt = str(tmp_path / "ckpt")
    first = ["train", "--steps", "1", "--quiet", "--layers", "1", "--checkpoint-dir", ckpt]
    assert main([*first, "--devices", "4", "--batch-size", "4"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--steps", "2", "--quiet", "--checkpoint-dir", ckpt]) == 0
    err = capsys.readouterr().err
    assert f"shardplug: --resume: on the 4 devices the checkpoint in {ckpt} ran on" in err
    assert main(["train", "--resume", "--steps", "3", "--quiet", "--checkpoint-dir", ckpt,
                 "--devices", "8"]) == 2  # fmt: skip
    line = one_line(capsys)
    assert line.startswith(
        "shardplug: error: --resume: the checkpoint's global batch of 4 (its --batch-size, "
        "which a resumed run keeps: its data position counts batches) does not split over the "
        "8 devices of this run: resume on --devices 4 as it ran, or on a count that divides 4 "
        "(1, 2, 4)"
    ), line
    for flag, value, had in (("--adapter", "equinox", "adapter nnx"),
                             ("--sequence", "16", "sequence 32")):  # fmt: skip
        assert main(["train", "--resume", "--steps", "3", "--checkpoint-dir", ckpt, flag,
                     value]) == 2  # fmt: skip
        line = one_line(capsys)
        assert line.startswith(f"shardplug: error: {flag} {value}: the run in {ckpt} was "
                               f"trained with {had}, and a resumed run keeps"), line  # fmt: skip


def test_the_readmes_pipeline_example_runs_on_the_devices_its_mesh_names(capsys):
    assert main(["explain", "--strategy", "pp", "--mesh", "stage=4", "--layers", "8",
                 "-o", "pp.schedule=1f1b"]) == 0  # fmt: skip
    assert capsys.readouterr().out.startswith("pp on 4 cpu devices (stage=4)")


def test_plot_refuses_what_is_no_metrics_file_and_no_picture_file(tmp_path, capsys):
    binary = tmp_path / "m.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["plot", str(binary)]) == 2
    assert one_line(capsys) == (f"shardplug: error: {binary}: not text, so not a metrics "
                                "file; give the JSON lines train --metrics-out wrote")  # fmt: skip
    rows = tmp_path / "m.jsonl"
    rows.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n')
    assert main(["plot", str(rows), "--out", "/dev/null"]) == 2
    assert "--out /dev/null is not a regular file (a device or a pipe)" in one_line(capsys)
    assert not pathlib.Path("/dev/null.png").exists()


def test_a_loss_of_three_values_that_are_no_state_says_what_a_loss_returns(tmp_path, capsys):
    task = tmp_path / "three.py"
    task.write_text(TASKS + "\ndef three():\n    return loss_says(lambda l: (l, {}, l))\n")
    assert main(["train", "--steps", "1", "--devices", "2", "--task", f"{task}:three"]) == 2
    line = one_line(capsys)
    assert ("loss_fn returned three values, read as (loss, metrics, new model state), and its "
            "third is an array, not the model's state: return (loss, metrics)" in line), line


def test_jaxs_cuda_plugin_without_cuda_is_quiet_without_a_gpu(monkeypatch):
    import logging

    from shardplug.cli import _CudaPlugin
    from shardplug.core import devices

    try:
        raise RuntimeError("Unable to load cuDNN. Is it installed?")
    except RuntimeError:
        import sys

        failed = sys.exc_info()
    record = logging.LogRecord("jax._src.xla_bridge", logging.ERROR, __file__, 1,
                               "Jax plugin configuration error: Exception when calling %s",
                               ("jax_plugins.xla_cuda12.initialize()",), failed)  # fmt: skip
    monkeypatch.setattr(devices, "nvidia_gpus", lambda: 0)
    assert not _CudaPlugin().filter(record)
    monkeypatch.setattr(devices, "nvidia_gpus", lambda: 8)
    assert _CudaPlugin().filter(record) and record.exc_info is None
    said = record.getMessage()
    assert said.startswith("JAX's CUDA plugin could not start (Unable to load cuDNN. Is it "
                           "installed?): JAX runs on the CPU"), said


def test_the_longest_sequence_search_ends_at_the_positions_and_the_time():
    from shardplug.planning.longest import longest_sequences

    class Planned:  # a step whose peak is its sequence in bytes; compiling takes no time
        def __init__(self, n):
            self.mesh, self.n = types.SimpleNamespace(shape={"data": 1}), n
            self.strategy = types.SimpleNamespace(
                shard_batch=lambda b, m: [types.SimpleNamespace(spec=P())])

    planned = []

    def compile_at(name, length, rows):
        planned.append(length)
        return Planned(length), {"tokens": np.zeros((1, length), np.int32)}

    import shardplug.planning.longest as recommend

    real = recommend.explain
    recommend.explain = lambda trainer, batch, device_memory: types.SimpleNamespace(
        per_device={"peak_bytes": trainer.n})
    try:
        found = longest_sequences(compile_at, 10**9, ["dp"], 32, limit=128)["strategies"][0]
        assert found["longest"] == 128 and found["capped"] and max(planned) == 128
        found = longest_sequences(compile_at, 10**9, ["dp"], 32, seconds=0.0)["strategies"][0]
        assert found["timed_out"] and found["longest"] is None
    finally:
        recommend.explain = real


def test_a_resume_that_would_change_its_run_is_one_line(tmp_path, capsys):
    """--lr, --seed, --init-from and --model that differ from the run a checkpoint holds:
    each refused naming the flag and the checkpoint's, not trained silently or as a
    mismatch of parameter paths."""
    ckpt = str(tmp_path / "ckpt")
    assert main(["train", "--steps", "1", "--quiet", "--layers", "1", "--devices", "2",
                 "--checkpoint-dir", ckpt]) == 0  # fmt: skip
    capsys.readouterr()
    for flags, says in (
        (["--lr", "0.1"], "--lr 0.1: the run in {ckpt} was trained with lr 0.003"),
        (["--seed", "5"], "--seed 5: the run in {ckpt} was trained with seed 0"),
        (["--init-from", "tests/fixtures/hf/llama"],
         "--init-from tests/fixtures/hf/llama: the run in {ckpt} trained --model transformer"),
    ):  # fmt: skip
        assert main(["train", "--resume", "--steps", "2", "--checkpoint-dir", ckpt,
                     *flags]) == 2  # fmt: skip
        line = one_line(capsys)
        assert says.format(ckpt=ckpt) in line, line


def test_a_metrics_file_of_the_users_is_never_rewritten(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nmore\n")
    assert main(["train", "--steps", "1", "--devices", "2", "--quiet", "--layers", "1",
                 "--metrics-out", str(notes)]) == 2  # fmt: skip
    assert "is not a row of a run's metrics" in one_line(capsys)
    assert notes.read_text() == "my notes\nmore\n"


def test_predict_step_takes_a_compiled_program_and_a_chip():
    import jax
    import jax.numpy as jnp

    import shardplug

    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((8, 8)))
    for program, says in ((lowered, "not a Lowered: compile it first"),
                          (None, "not a NoneType"), ("garbage", "no compiled program's HLO"),
                          ("", "no compiled")):  # fmt: skip
        with pytest.raises(shardplug.ConfigError, match=says):
            shardplug.predict_step(program, "h100")
    with pytest.raises(shardplug.ConfigError, match="chip is a GPU's name"):
        shardplug.predict_step(lowered.compile(), 5)


@pytest.mark.parametrize(("argv", "says"), [
    (["recommend", "--strategies", "dp,dp", "--device-memory", "1GB"], "names dp twice"),
    (["recommend", "--search-seconds", "5", "--device-memory", "1GB"], "give --longest-sequence"),
    (["launch", "--nprocs", "2", "--min-nprocs", "1", "--", "train"], "give --restarts N too"),
    (["bench", "--plan", "--steps", "3"], "takes no --steps or --rounds"),
])  # fmt: skip
def test_flags_that_need_another_say_so(argv, says, capsys):
    assert main(argv) == 2
    assert says in one_line(capsys)
