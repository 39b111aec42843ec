"""Checkpoints: resume onto any strategy and device count, survive crashes, never load damage."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import reference_trainer, said

import shardplug
from shardplug.cli import main
from shardplug.running.checkpoint import Checkpoints

SUBPROCESS_ENV = {
    **os.environ,
    "SHARDPLUG_PLUGINS": "",
    "XLA_FLAGS": "--xla_backend_optimization_level=0",
}


def trainer_for(model_name="cnn", adapter="nnx", strategy="dp", devices=8, **kwargs):
    return reference_trainer(model_name, strategy, adapter=adapter, devices=devices, **kwargs)


def losses(rows):
    return [r["loss"] for r in rows]


def read_rows(path: Path, complete_lines_only: bool = False) -> list[dict]:
    text = path.read_text()
    if complete_lines_only:  # a killed writer may leave half a line
        text = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in text.splitlines()]


def damage(folder: Path, where: str = "/d/") -> int:
    """Overwrite the middle of every matching file with garbage, as a failing disk would."""
    count = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if where in path:
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.seek(size // 2)
                    f.write(os.urandom(max(1, min(64, size - size // 2))))
                count += 1
    return count


# --- resume onto anything ---------------------------------------------------------------


def test_cli_resume_with_another_strategy_and_device_count_continues_exactly(tmp_path, capsys):
    """The issue's acceptance run: fsdp on 8 devices for 20 steps, against 10 steps with
    checkpoints and a resume to 20 with dp on 4 devices."""
    common = ["train", "--model", "cnn", "--quiet", "--seed", "0"]
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    assert main([*common, "--strategy", "fsdp", "--steps", "20", "--metrics-out", str(full)]) == 0
    first = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"]
    assert main([*common, "--strategy", "fsdp", "--steps", "10", *first,
                 "--metrics-out", str(resumed)]) == 0  # fmt: skip
    assert sorted(int(p.name) for p in ckpt.iterdir()) == [5, 10]
    # --model etc. come from the checkpoint
    argv = ["train", "--resume", "--checkpoint-dir", str(ckpt), "--strategy", "dp",
            "--devices", "4", "--steps", "20", "--quiet",
            "--metrics-out", str(resumed)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trained cnn (nnx) with dp on 4 cpu devices" in out and "from step 10" in out
    want, got = read_rows(full), read_rows(resumed)
    assert [r["step"] for r in got] == list(range(20))  # appended after the first 10
    np.testing.assert_allclose(losses(got[10:]), losses(want[10:]), rtol=1e-4)


@pytest.mark.parametrize(
    ("adapter", "before", "after"),
    [("linen", ("fsdp", 8, None), ("2d", 8, "data=2,model=4")), ("equinox", ("2d", 8, None),
     ("pmap", 2, None))],
)  # fmt: skip
def test_every_adapter_resumes_onto_another_mesh(adapter, before, after, tmp_path):
    strategy, devices, mesh = before
    model, uninterrupted = trainer_for("cnn", adapter, strategy, devices, mesh=mesh)
    want = losses(uninterrupted.fit(model.batches(model.batch_size, 0), 8))

    _, first = trainer_for("cnn", adapter, strategy, devices, mesh=mesh, checkpoint_dir=tmp_path)
    first.fit(model.batches(model.batch_size, 0), 4)
    strategy, devices, mesh = after
    _, second = trainer_for("cnn", adapter, strategy, devices, mesh=mesh, checkpoint_dir=tmp_path)
    assert second.restore() == 4 == second.step
    rows = second.fit(model.batches(model.batch_size, 0, start=second.step), 4)
    assert [r["step"] for r in rows] == [4, 5, 6, 7]
    np.testing.assert_allclose(losses(rows), want[4:], rtol=1e-4)
    # read straight into the new run's shardings
    assert jax.tree.leaves(second.state.params)[0].sharding.mesh == second.mesh


def test_a_checkpoint_holds_the_configuration_and_data_position(tmp_path):
    model, trainer = trainer_for("mlp", checkpoint_dir=tmp_path, config={"note": "run 7"})
    trainer.fit(model.batches(model.batch_size, 0), 3)
    meta = Checkpoints(tmp_path).read_meta(3)
    assert meta["data_position"] == 3 and meta["config"] == {"note": "run 7"}
    assert meta["strategy"] == "dp" and meta["devices"] == 8
    names = set(meta["arrays"])
    assert {"step", "rng"} <= names
    assert any(n.startswith("params/") for n in names)
    assert any(n.startswith("opt_state/") for n in names)


# --- crashes and signals ------------------------------------------------------------------


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardplug", *args]


def test_sigkill_in_the_middle_of_a_run_then_resume(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = ["train", "--model", "mlp", "--steps", "100000", "--quiet",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--log-every", "2",
            "--metrics-out", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(cli(*argv), env=SUBPROCESS_ENV, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # checkpointing every 2 steps, it is always saving
            if ckpt.is_dir() and len([p for p in ckpt.iterdir() if p.name.isdigit()]) >= 3:
                break
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoints appeared")
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    killed_rows = read_rows(metrics, complete_lines_only=True)
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    target = complete[-1] + 4
    done = subprocess.run(
        cli("train", "--resume", "--checkpoint-dir", str(ckpt), "--steps", str(target),
            "--quiet", "--metrics-out", str(metrics), "--log-every", "2"),
        env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert f"from step {complete[-1]}" in done.stdout
    rows = read_rows(metrics)  # the abandoned steps past the checkpoint are replaced
    assert [r["step"] for r in rows] == list(range(target))
    rows = rows[complete[-1] :]
    # the steps both runs took agree: the resumed run continued the killed one exactly
    before = {r["step"]: r["loss"] for r in killed_rows}
    shared = [r for r in rows if r["step"] in before]
    assert shared, "the killed run had logged past its last checkpoint"
    np.testing.assert_allclose(losses(shared), [before[r["step"]] for r in shared], rtol=1e-5)


def test_sigterm_finishes_the_step_saves_and_exits(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = ["train", "--model", "mlp", "--steps", "100000", "--quiet", "--log-every", "1",
            "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(
        cli(*argv), env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "stopped by SIGTERM" in x]
    step = int(line.split("after step ")[1].split(";")[0])
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [step]
    assert len(read_rows(metrics)) == step  # every step it took was logged


def test_sigint_in_python_raises_training_interrupted_after_saving(tmp_path):
    model, trainer = trainer_for("mlp", checkpoint_dir=tmp_path, log_every=1)
    calls = []
    before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN in a background job

    def interrupt_once(rows):
        calls.append(rows)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(shardplug.TrainingInterrupted, match="stopped by SIGINT after step") as e:
        trainer.fit(model.batches(model.batch_size, 0), 1000, callback=interrupt_once)
    assert e.value.step == trainer.step == 2
    assert e.value.checkpoint == str(tmp_path.absolute() / "2")
    assert Checkpoints(tmp_path).steps() == [2]
    assert signal.getsignal(signal.SIGINT) is before  # the handler given back


# --- damage -------------------------------------------------------------------------------


def saved_run(tmp_path, steps=6, every=2):
    model, trainer = trainer_for("mlp", checkpoint_dir=tmp_path, checkpoint_every=every)
    trainer.fit(model.batches(model.batch_size, 0), steps)
    return model, trainer


@pytest.mark.parametrize("where", ["/d/", "meta/metadata"], ids=["arrays", "metadata"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, where):
    model, _ = saved_run(tmp_path)
    assert damage(tmp_path / "6", where) > 0
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    with pytest.warns(shardplug.ShardplugWarning, match=f"checkpoint {tmp_path}/6 is damaged"):
        assert trainer.restore() == 4
    assert (tmp_path / "6.damaged").is_dir()  # moved aside, not deleted; step 6 can be saved
    trainer.fit(model.batches(model.batch_size, 0, start=4), 2)
    assert Checkpoints(tmp_path).steps() == [2, 4, 6]


def test_an_unreadable_checkpoint_is_not_damage_and_is_left_alone(tmp_path, monkeypatch):
    """Permission denied or an I/O error is trouble, not damage: restore stops naming the file
    and the real cause, and moves nothing (before, it set the newest checkpoint aside and
    quietly resumed from an older one). Simulated: the suite runs as root, which reads all."""
    from shardplug.running import checkpoint_checks as checkpoint

    saved_run(tmp_path, steps=4)
    files = sorted(p for p in (tmp_path / "4").rglob("*") if p.is_file())
    locked = files[len(files) // 2]
    plain = checkpoint._read_one

    def read_one(path):
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        plain(path)

    monkeypatch.setattr(checkpoint, "_read_one", read_one)
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    with pytest.raises(shardplug.CheckpointError) as error:
        trainer.restore()
    assert str(error.value).startswith(f"cannot read {locked}: Permission denied; the checkpoint")
    assert Checkpoints(tmp_path).steps() == [2, 4] and not list(tmp_path.glob("*.damaged"))


def test_arrays_that_differ_from_their_fingerprint_are_never_loaded(tmp_path):
    saved_run(tmp_path)
    meta_file = tmp_path / "6" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    name = next(n for n in meta["fingerprints"] if n.startswith("params/"))
    meta["fingerprints"][name] ^= 1
    meta_file.write_text(json.dumps(meta))
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    with pytest.warns(shardplug.ShardplugWarning, match=f"differ from what was saved \\({name}"):
        assert trainer.restore() == 4


def test_when_every_checkpoint_is_damaged_restore_fails_clearly(tmp_path):
    saved_run(tmp_path, steps=4)
    for step in (2, 4):
        damage(tmp_path / str(step))
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    with (
        pytest.warns(shardplug.ShardplugWarning),
        pytest.raises(shardplug.CheckpointError, match="no good checkpoint in"),
    ):
        trainer.restore()


def test_cli_resume_reports_damage_in_one_line_and_falls_back(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", "mlp", "--quiet", "--checkpoint-dir", str(ckpt)]
    assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
    damage(ckpt / "4")
    capsys.readouterr()
    assert main([*base, "--steps", "6", "--resume"]) == 0
    captured = capsys.readouterr()
    warning = said(captured.err)
    assert len(warning) == 1 and warning[0].startswith("shardplug: warning: checkpoint ")
    assert f"{ckpt}/4 is damaged" in warning[0] and "trying step 2" in warning[0]
    assert "from step 2" in captured.out


def test_a_checkpoint_of_another_model_names_the_parameters(tmp_path):
    saved_run(tmp_path, steps=2)
    _, other = trainer_for("classifier", checkpoint_dir=tmp_path)
    with pytest.raises(shardplug.CheckpointError, match="of a different model or optimizer") as e:
        other.restore()
    assert "params/" in str(e.value) and "different shape or dtype" in str(e.value)


# --- numerical faults ---------------------------------------------------------------------


def poisoned(model, at: int):
    """The model's batches, with NaN inputs in batch ``at``."""
    for i, batch in enumerate(model.batches(model.batch_size, 0)):
        yield {**batch, "x": batch["x"] * np.float32("nan")} if i == at else batch


def test_a_nonfinite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    model, trainer = trainer_for("mlp", checkpoint_dir=tmp_path, checkpoint_every=2, log_every=1)
    with pytest.raises(shardplug.NonFiniteError, match=r"not finite .* at step 3") as e:
        trainer.fit(poisoned(model, 3), 10)
    assert e.value.step == 3 and e.value.checkpoint == str(tmp_path.absolute() / "2")
    assert Checkpoints(tmp_path).steps() == [2]  # nothing after the fault was saved
    assert np.isnan(trainer.history[-1]["loss"]) and trainer.history[-1]["step"] == 3


def test_skip_leaves_the_model_as_it_was_and_counts(tmp_path):
    model, trainer = trainer_for("mlp", on_nonfinite="skip", strategy="pmap")
    batches = poisoned(model, 2)
    trainer.fit(batches, 2)
    before = jax.device_get(trainer.state.params)
    rows = trainer.fit(batches, 1)
    assert rows[0]["skipped"] == 1.0 and trainer.skipped_steps == 1
    after = jax.device_get(trainer.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = trainer.fit(batches, 3)
    assert all(np.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in rows)


# --- export -------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", ["nnx", "linen", "equinox"])
def test_export_loads_back_into_the_users_model(adapter, tmp_path, capsys):
    model, trainer = trainer_for("cnn", adapter, "fsdp", checkpoint_dir=tmp_path / "ckpt")
    trainer.fit(model.batches(model.batch_size, 0), 3)
    out = tmp_path / "weights.npz"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert f"exported step 3 of {tmp_path / 'ckpt'}" in capsys.readouterr().out
    loaded = shardplug.load_model(out, model.adapter(adapter))
    state = None
    if adapter == "equinox":  # a model with state comes back as (model, state)
        loaded, state = loaded
    batch = {"image": next(model.batches(16, 99))["image"], "label": np.zeros(16, np.int32)}
    key = jax.random.key(0)
    want = trainer.evaluate([batch])  # the trained model, in evaluation mode
    got = model.loss_fn(loaded, batch, rng=key, train=False, state=state)
    np.testing.assert_allclose(float(got[0]), want["loss"], rtol=1e-6)


def test_export_never_unpickles_and_never_overwrites(tmp_path, capsys):
    evil = tmp_path / "evil.npz"
    np.savez(evil, __shardplug__=np.array([object()], dtype=object))
    with pytest.raises(shardplug.CheckpointError, match="is not a shardplug export"):
        shardplug.load_exported(evil)
    saved_run(tmp_path / "ckpt", steps=2)
    out = tmp_path / "w.npz"
    out.write_bytes(b"keep me")
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


# --- bad input ----------------------------------------------------------------------------


def test_a_checkpoint_dir_that_is_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(shardplug.ConfigError, match="is not writable"):
        trainer_for("mlp", checkpoint_dir=blocker / "ckpt")


def test_trainer_refuses_to_overwrite_another_runs_checkpoints(tmp_path):
    saved_run(tmp_path, steps=2)
    model, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    with pytest.raises(shardplug.CheckpointError, match="already holds checkpoints"):
        trainer.fit(model.batches(model.batch_size, 0), 2)


@pytest.fixture
def with_checkpoints(tmp_path):
    saved_run(tmp_path / "full", steps=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    return tmp_path


BAD = [
    (["--resume", "--checkpoint-dir", "{tmp}/missing"],
     "checkpoint directory {tmp}/missing does not exist"),
    (["--resume", "--checkpoint-dir", "{tmp}/empty"], "holds no complete checkpoint"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-every", "0", "--checkpoint-dir", "{tmp}/new"], "must be positive, got 0"),
    (["--checkpoint-dir", "{tmp}/file"], "is a file: name a directory"),
    (["--checkpoint-dir", "{tmp}/file/sub"], "is not writable"),
    (["--checkpoint-dir", "{tmp}/full"],
     "already holds checkpoints (newest: step 2); pass --resume"),
    (["--resume", "--checkpoint-dir", "{tmp}/full", "--model", "classifier"],
     "is of a different model or optimizer; different shape or dtype: params/"),
    (["--resume", "--checkpoint-dir", "{tmp}/full", "--batch-size", "32"],
     "the checkpoint's run read batches of shapes [[64, 16], [64, 1]], this one reads [[32, "),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_checkpoint_input_is_one_line_and_exit_2(args, message, with_checkpoints, capsys):
    tmp = str(with_checkpoints)
    metrics = with_checkpoints / "metrics.jsonl"
    metrics.write_text("earlier run\n")
    before = sorted(p.name for p in (with_checkpoints / "full").iterdir())
    argv = ["train", "--model", "mlp", "--quiet", "--steps", "4", "--metrics-out", str(metrics)]
    code = main([*argv, *(a.replace("{tmp}", tmp) for a in args)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shardplug: error: ") and message.replace("{tmp}", tmp) in lines[0]
    assert metrics.read_text() == "earlier run\n"
    assert sorted(p.name for p in (with_checkpoints / "full").iterdir()) == before


def test_resuming_with_other_batch_shapes_is_refused(tmp_path):
    """The data position counts batches: resumed with another batch size, a plain iterable
    would read other samples than the uninterrupted run, without a word. Now it is refused."""
    model, _ = saved_run(tmp_path, steps=2)
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    assert trainer.restore() == 2
    half = model.batch_size // 2
    with pytest.raises(shardplug.BatchError, match=rf"batches of shapes \[\[{model.batch_size},"):
        trainer.fit(model.batches(half, 0, start=2), 2)
    assert trainer.fit(model.batches(model.batch_size, 0, start=2), 2)  # the same shapes: on


def test_a_step_compiled_before_the_restore_is_checked_against_its_batch_shapes(tmp_path):
    """The command line compiles the step before it reads the checkpoint: the restore checks
    the compiled step's batches, and refuses them leaving the trainer as it was."""
    model, _ = saved_run(tmp_path, steps=2)
    _, trainer = trainer_for("mlp", checkpoint_dir=tmp_path)
    trainer.compile(next(iter(model.batches(model.batch_size // 2, 0))))
    with pytest.raises(shardplug.BatchError, match=rf"batches of shapes \[\[{model.batch_size},"):
        trainer.restore()
    assert trainer.step == 0 and trainer.restored_meta is None


ENV_BATCH_TASK = """
import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplug


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def task():
    rows = int(os.environ["BS"])

    def batches():
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(rows, 4)).astype(np.float32)
            yield {"x": x, "y": x[:, :1]}

    adapter = shardplug.from_nnx(lambda rngs: nnx.Linear(4, 1, rngs=rngs))
    return shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1),
                          data=batches)
"""


def test_cli_resume_of_a_plain_generator_with_another_batch_size_is_refused(
    tmp_path, capsys, monkeypatch
):
    """A task's data as a function returning a generator, checkpointed at 16 rows a batch and
    resumed at 32: one line and exit 2, the checkpoints as they were; at 16 it resumes."""
    (tmp_path / "envbs.py").write_text(ENV_BATCH_TASK)
    ckpt = tmp_path / "ck"
    argv = ["train", "--task", f"{tmp_path / 'envbs.py'}:task", "--checkpoint-dir", str(ckpt),
            "--quiet"]  # fmt: skip
    monkeypatch.setenv("BS", "16")
    assert main([*argv, "--steps", "5"]) == 0
    capsys.readouterr()
    before = sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    monkeypatch.setenv("BS", "32")
    assert main([*argv, "--resume", "--steps", "10"]) == 2
    err = said(capsys.readouterr().err)
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("shardplug: error: the checkpoint's run read batches of shapes "
                             "[[16, 4], [16, 1]], this one reads [[32, 4], [32, 1]]: resume "
                             "with the same batch size")  # fmt: skip
    assert sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
    monkeypatch.setenv("BS", "16")
    assert main([*argv, "--resume", "--steps", "6"]) == 0
    assert "from step 5" in capsys.readouterr().out


def test_a_resume_keeps_the_experts_and_routing_the_checkpoint_was_trained_with(tmp_path, capsys):
    from shardplug.cli import main

    ck = str(tmp_path / "ck")
    base = ["train", "--checkpoint-dir", ck, "--quiet", "--layers", "1", "--batch-size", "8"]
    assert main([*base, "--experts", "4", "--steps", "1"]) == 0
    capsys.readouterr()
    for flag, message in [
        (["--top-k", "1"], "--top-k 1: the run in "),
        (["--experts", "2"], "--experts 2: the run in "),
    ]:
        assert main([*base, "--resume", "--steps", "2", *flag]) == 2
        err = capsys.readouterr().err
        assert message in err and "was trained with" in err and len(err.splitlines()) == 1
    # the experts come back with the checkpoint: a strategy placing them resumes it
    assert main([*base, "--resume", "--steps", "2", "--strategy", "dp+ep",
                 "--mesh", "data=2,expert=4"]) == 0, capsys.readouterr().err  # fmt: skip
    assert "from step 1" in capsys.readouterr().out


def test_damaged_checkpoints_are_said_in_their_lines_alone(tmp_path):
    """Every step damaged: a warning per step and the refusal, in words, and nothing else
    (Orbax's un-retrieved futures and unfinished coroutines, TensorStore's text); Orbax's
    complaint about a garbage metadata file of a checkpoint that restores is not passed on."""
    import subprocess
    import sys

    from shardplug.cli import main

    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", "mlp", "--quiet", "--checkpoint-dir", str(ckpt)]
    assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
    (ckpt / "4" / "_CHECKPOINT_METADATA").write_text("garbage")
    resume = [sys.executable, "-m", "shardplug", *base, "--resume"]
    done = subprocess.run([*resume, "--steps", "5"], capture_output=True, text=True)
    assert done.returncode == 0 and "absl" not in done.stderr, done.stderr[-2000:]
    for step in (2, 4, 5):
        for path in (ckpt / str(step) / "state").rglob("*"):
            if path.is_file() and "/d/" in str(path):
                path.write_bytes(b"garbage")
    done = subprocess.run([*resume, "--steps", "8"], capture_output=True, text=True)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 4, done.stderr[-3000:]
    assert all(line.startswith("shardplug: warning: checkpoint ") for line in lines[:3])
    assert "a data file under its state/ folder is damaged or missing" in lines[0]
    assert lines[3].startswith("shardplug: error: no good checkpoint in ")
    assert "TensorStore" not in done.stderr and "bound method" not in done.stderr


LATE_REFUSAL_TASK = """
import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardplug
from shardplug.running.data import Batches


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def made(data):
    adapter = shardplug.from_nnx(lambda rngs: nnx.Linear(4, 1, rngs=rngs))
    return shardplug.Task(adapter=adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1), data=data)


def grain():
    x = np.random.default_rng(int(os.environ["SEED"])).normal(size=(256, 4)).astype(np.float32)
    return made(Batches([{"x": r, "y": r[:1]} for r in x], 16, name="rows"))


def stream():
    def batches(rows):
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(rows, 4)).astype(np.float32)
            yield {"x": x, "y": x[:, :1]}

    return made(batches(int(os.environ["BS"])))  # an iterator: compiled for in fit
"""


@pytest.mark.parametrize(
    ("task", "env", "saved", "other", "message"),
    [
        ("grain", "SEED", "0", "1", "the checkpoint's data state is of another data set"),
        ("stream", "BS", "16", "32",
         "the checkpoint's run read batches of shapes [[16, 4], [16, 1]], this one reads [[32,"),
    ],
    ids=["another-data-set", "an-iterator-of-other-batch-shapes"],
)  # fmt: skip
def test_a_resume_refused_once_training_starts_leaves_the_metrics_file_as_it_was(
    task, env, saved, other, message, tmp_path, capsys, monkeypatch
):
    """Refused in fit, after the restore: the interrupted run's rows past its checkpoint and
    its half-written line stay, byte for byte; resumed with its own data, they are replaced."""
    (tmp_path / "late.py").write_text(LATE_REFUSAL_TASK)
    metrics = tmp_path / "m.jsonl"
    argv = ["train", "--task", f"{tmp_path / 'late.py'}:{task}", "--quiet", "--checkpoint-dir",
            str(tmp_path / "ck"), "--metrics-out", str(metrics)]  # fmt: skip
    monkeypatch.setenv(env, saved)
    assert main([*argv, "--steps", "4"]) == 0
    with metrics.open("a") as out:  # a killed run logged past its checkpoint, the last half
        out.write('{"step": 4, "loss": 0.5}\n{"step": 5, "lo')
    written = metrics.read_bytes()
    capsys.readouterr()
    monkeypatch.setenv(env, other)
    assert main([*argv, "--resume", "--steps", "8"]) == 2
    err = said(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"shardplug: error: {message}"), err
    assert metrics.read_bytes() == written
    monkeypatch.setenv(env, saved)
    assert main([*argv, "--resume", "--steps", "6"]) == 0
    assert [r["step"] for r in read_rows(metrics)] == list(range(6))
