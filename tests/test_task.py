"""shardplug.task: tasks from files and modules, on every command; and their bad input."""

import importlib.machinery
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import said

import shardplug
from shardplug.cli import main
from shardplug.errors import BatchError, CheckpointError, TaskError
from shardplug.task import Task, load_task

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def guide_task_files(folder: Path) -> dict[str, Path]:
    """The task files the guide shows (blocks that start ``# file: NAME.py``), written out."""
    files = {}
    for block in re.findall(r"```python\n(# file: (\w+\.py)\n.*?)```", GUIDE.read_text(), re.S):
        text, name = block
        (folder / name).write_text(text)
        files[name] = folder / name
    return files


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    return guide_task_files(tmp_path_factory.mktemp("tasks"))


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_guide_shows_a_task_file_for_each_framework(task_files):
    assert set(task_files) == {"nnx_task.py", "linen_task.py", "equinox_task.py"}
    frameworks = {load_task(f"{path}:task").adapter.framework for path in task_files.values()}
    assert frameworks == {"nnx", "linen", "equinox"}


@pytest.mark.parametrize("name", ["nnx_task.py", "linen_task.py", "equinox_task.py"])
def test_every_guide_task_file_trains_under_fsdp_from_the_command_line(task_files, tmp_path, name):
    out = tmp_path / "rows.jsonl"
    argv = ["train", "--task", f"{task_files[name]}:task", "--strategy", "fsdp", "--steps", "30",
            "--log-every", "10", "--metrics-out", str(out), "--quiet"]  # fmt: skip
    if name == "nnx_task.py":
        argv += ["--eval-every", "15"]
    assert main(argv) == 0
    rows = rows_of(out)
    assert [r["step"] for r in rows] == list(range(30))
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    if name == "nnx_task.py":  # held-out rows at steps 15 and 30
        assert [r["step"] for r in rows if "eval_loss" in r] == [14, 29]


def test_explain_recommend_bench_and_export_run_on_a_task_file(task_files, tmp_path, capsys):
    spec = f"{task_files['nnx_task.py']}:task"
    assert main(["explain", "--task", spec, "--strategy", "fsdp+tp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "fsdp+tp"
    assert {p["path"] for p in report["params"]} >= {"linear1/kernel", "linear2/kernel"}
    assert main(["recommend", "--task", spec, "--device-memory", "1GB", "--json"]) == 0
    recommended = json.loads(capsys.readouterr().out)
    assert recommended["recommended"] in {r["strategy"] for r in recommended["strategies"]}
    assert main(["bench", "--task", spec, "--strategies", "fsdp", "--steps", "2", "--rounds",
                 "1", "--json"]) == 0  # fmt: skip
    bench = json.loads(capsys.readouterr().out)
    assert bench["model"] == "task" and bench["max_loss_diff"]["fsdp"] < 1e-5
    ckpt = tmp_path / "ckpt"
    assert main(["train", "--task", spec, "--steps", "3", "--checkpoint-dir", str(ckpt),
                 "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["export", "--task", spec, "--checkpoint-dir", str(ckpt), "--out",
                 str(tmp_path / "w.npz")]) == 0  # fmt: skip
    assert "loaded back into task task's model" in capsys.readouterr().out
    other = f"{task_files['equinox_task.py']}:task"
    assert main(["export", "--task", other, "--checkpoint-dir", str(ckpt), "--out",
                 str(tmp_path / "x.npz")]) == 2  # fmt: skip
    assert "does not fit this model" in capsys.readouterr().err


def test_a_module_task_and_a_function_returning_one_load():
    task = load_task("shardplug.builtin_tasks:classifier")
    assert isinstance(task, Task) and task.name == "classifier"
    assert task.adapter.framework == "nnx"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD_TASKS = [
    ("missing.py:task", None, "task file missing.py does not exist"),
    ("{f}:nope", "import shardplug\n", "defines no 'nope'"),
    ("{f}:task", "task = 3\n", "task is a int, not a shardplug.Task"),
    ("{f}:task", "raise RuntimeError('boom')\n", "failed to import: RuntimeError: boom"),
    ("no_such_module_xyz:task", None, "task module 'no_such_module_xyz' not found"),
]


@pytest.mark.parametrize(("spec", "text", "says"), BAD_TASKS)
def test_a_bad_task_is_one_line_and_a_typed_error(tmp_path, capsys, monkeypatch, spec, text, says):
    monkeypatch.chdir(tmp_path)
    if text is not None:
        spec = spec.format(f=write(tmp_path / "t.py", text))
    with pytest.raises(TaskError, match=re.escape(says)):
        load_task(spec)
    assert main(["train", "--task", spec, "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def project(folder: Path, prefix: str) -> str:
    """A task file whose model and (read lazily) data are modules beside it: its spec."""
    folder.mkdir()
    write(folder / f"{prefix}_model.py", TASK_HEADER)
    write(folder / f"{prefix}_rows.py", "import numpy as np\nX = np.ones((8, 4), np.float32)\n")
    text = f"""
import optax

import shardplug
from {prefix}_model import adapter, loss_fn


def batches():
    from {prefix}_rows import X  # imported when the data is read

    while True:
        yield {{"x": X, "y": X[:, :1]}}


task = shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1), data=batches)
"""
    return write(folder / "task.py", text) + ":task"


def test_a_task_file_imports_the_modules_beside_it(tmp_path, monkeypatch, capsys):
    """As ``python task.py`` would: the task's folder is on the import path while it is
    imported and after (its data imports a module beside it only when read), on every
    command, without PYTHONPATH."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    task = load_task(project(tmp_path / "project", "beside_a"))
    assert next(iter(task.batches()))["x"].shape == (8, 4)
    assert sys.path.count(str(tmp_path / "project")) == 1
    assert main(["explain", "--task", project(tmp_path / "b", "beside_b"), "--json"]) == 0
    recommend = ["recommend", "--task", project(tmp_path / "c", "beside_c"), "--device-memory"]
    assert main([*recommend, "1GB", "--json"]) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "shardplug", "train", "--task", "project/task.py:task",
         "--steps", "2", "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained task (nnx)" in done.stdout


def test_the_modules_beside_a_task_file_shadow_nothing(tmp_path, monkeypatch):
    """Two task folders with a module of the same name: each task imports its own. Once a
    task is imported its folder is searched last, so a file beside it named like an
    installed package (optax.py) is not what a later import finds."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    specs = {}
    for who in ("a", "b"):
        folder = tmp_path / who
        folder.mkdir()
        write(folder / "beside_same.py", TASK_HEADER + f"WHO = {who!r}\n")
        write(folder / "optax.py", "raise ImportError('the file beside the task')\n")
        specs[who] = write(
            folder / "task.py",
            "import optax\nimport shardplug\nfrom beside_same import WHO, adapter, loss_fn\n\n"
            "task = shardplug.Task(adapter, loss_fn, optax.sgd(0.1), data=[], name=WHO)\n",
        )
    assert [load_task(f"{specs[who]}:task").name for who in ("a", "b")] == ["a", "b"]
    assert load_task(f"{specs['a']}:task").name == "a"  # loaded once: the same module
    found = importlib.machinery.PathFinder.find_spec("optax")
    assert found is not None and str(tmp_path) not in found.origin
    assert sys.path[-2:] == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_a_task_whose_batches_change_shape_fails_at_that_step(tmp_path, capsys):
    spec = write(
        tmp_path / "t.py",
        TASK_HEADER
        + """
def batches():
    for rows in (16, 16, 8):
        yield {"x": np.ones((rows, 4), np.float32), "y": np.ones((rows, 1), np.float32)}

task = shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1), data=batches)
""",
    )
    assert main(["train", "--task", f"{spec}:task", "--steps", "3", "--quiet"]) == 2
    err = said(capsys.readouterr().err)
    assert len(err) == 1 and "batch 2" in err[0] and "(8, 4)" in err[0], err
    task = load_task(f"{spec}:task")
    trainer = shardplug.Trainer(task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer)
    with pytest.raises(BatchError):
        trainer.fit(task.batches(), 3)


TASK_HEADER = """
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplug

adapter = shardplug.from_nnx(lambda rngs: nnx.Linear(4, 1, rngs=rngs))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
"""


def test_a_grain_state_from_another_data_set_is_refused_on_resume(tmp_path, capsys):
    spec = write(
        tmp_path / "t.py",
        TASK_HEADER
        + """
from shardplug.running.data import Batches

def records(seed):
    x = np.random.default_rng(seed).normal(size=(256, 4)).astype(np.float32)
    return [{"x": r, "y": r[:1]} for r in x]

def a():
    return shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1),
                          data=Batches(records(0), 16, name="a"))

def b():
    return shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1),
                          data=Batches(records(1), 16, name="b"))
""",
    )
    ckpt = str(tmp_path / "ckpt")
    argv = ["train", "--steps", "4", "--checkpoint-dir", ckpt, "--quiet"]
    assert main([*argv, "--task", f"{spec}:a"]) == 0
    capsys.readouterr()
    argv[2] = "8"
    assert main([*argv, "--task", f"{spec}:b", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "data state is of another data set" in err and err.count("\n") == 1, err
    assert main([*argv, "--task", f"{spec}:a", "--resume"]) == 0  # its own data: resumes
    with pytest.raises(CheckpointError, match="another data set"):
        task = load_task(f"{spec}:b")
        it = iter(task.data)
        it.set_state(iter(load_task(f"{spec}:a").data).get_state())


def test_an_error_in_the_tasks_own_code_is_one_line_naming_where(tmp_path, capsys, monkeypatch):
    spec = write(
        tmp_path / "t.py",
        TASK_HEADER
        + """
def broken(model, batch):
    raise ValueError("the loss is broken")

task = shardplug.Task(adapter=adapter, loss_fn=broken, optimizer=optax.sgd(0.1),
                      data=[{"x": np.ones((8, 4), np.float32)}])
""",
    )
    for command in ("train", "explain"):
        assert main([command, "--task", f"{spec}:task"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "the task's code raised ValueError: the loss is broken (" in err
        assert f"t.py:{len(TASK_HEADER.splitlines()) + 3} in broken" in err
    monkeypatch.setenv("SHARDPLUG_TRACEBACK", "1")  # asked for: the whole traceback
    with pytest.raises(ValueError, match="the loss is broken"):
        main(["explain", "--task", f"{spec}:task"])


def test_task_flags_of_the_reference_model_are_refused_with_a_task(capsys):
    assert main(["train", "--task", "shardplug.builtin_tasks:digits", "--layers", "4"]) == 2
    assert "--layers set the reference model" in capsys.readouterr().err


def test_a_task_checks_its_fields():
    with pytest.raises(TaskError, match="adapter must be a shardplug adapter"):
        Task(adapter=object(), loss_fn=len, optimizer=None, data=[])  # type: ignore[arg-type]
    with pytest.raises(TaskError, match="data must be an iterable"):
        Task(adapter=shardplug.get_model("mlp").adapter(), loss_fn=len,
             optimizer=__import__("optax").sgd(0.1), data=3)  # fmt: skip


def test_the_digits_task_reports_held_out_accuracy(tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = ["train", "--task", "shardplug.builtin_tasks:digits", "--strategy", "fsdp", "--steps",
            "150", "--eval-every", "150", "--log-every", "50", "--metrics-out", str(out),
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    last = rows_of(out)[-1]
    assert last["eval_accuracy"] > 0.9  # 320 digits it never trained on
    assert np.isfinite(last["eval_loss"])


def test_sizes_reach_a_task_function_that_takes_them(capsys):
    """--sequence (and --batch-size) size a task function with those parameters; one
    without them is one line naming the flag and the signature it needs."""
    task = load_task("examples/tasks/llama.py:tiny", sequence=64, batch_size=4)
    assert next(iter(task.batches()))["tokens"].shape == (4, 64)
    with pytest.raises(TaskError, match=r"digits takes no sequence, so --sequence cannot size"):
        load_task("shardplug.builtin_tasks:digits", sequence=64)
    assert main(["explain", "--task", "shardplug.builtin_tasks:digits", "--sequence", "64"]) == 2
    err = capsys.readouterr().err
    assert "def digits(sequence=...) -> Task" in err and err.count("\n") == 1
