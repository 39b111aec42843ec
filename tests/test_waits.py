"""Nothing waits forever on the user's data: a stalled read is announced, bounded by
--data-timeout, and SIGTERM while waiting saves the steps already taken."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from shardplug.errors import BatchError
from shardplug.loop.waits import DataWait

STALLING_TASK = """
import threading, optax, shardplug

def task():
    model = shardplug.get_model("mlp")

    def data():
        for i, batch in enumerate(model.batches(model.batch_size, 0)):
            if i == 3:
                threading.Event().wait()  # the reader hangs: nothing more ever comes
            yield batch

    return shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3), data)
"""
ENV = {**os.environ, "SHARDPLUG_PLUGINS": "", "XLA_FLAGS": "--xla_backend_optimization_level=0"}


def test_a_long_wait_is_announced_once(capsys):
    with DataWait(notice_s=0.2) as wait, wait.on("batch 7"):
        time.sleep(0.8)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("shardplug: waiting ")
    assert err[0].endswith("s for batch 7: the task's data has not produced it")


def test_a_wait_past_its_limit_raises_in_the_waiting_thread():
    start = time.monotonic()
    with (
        pytest.raises(BatchError, match=r"no batch 3 after \d+ s: .* --data-timeout 0.5"),
        DataWait(limit_s=0.5, notice_s=60) as wait,
        wait.on("batch 3"),
    ):
        threading.Event().wait(30)  # blocked in C, as a stalled reader would be
    assert time.monotonic() - start < 5


def train(tmp_path, *args):
    task = tmp_path / "stall.py"
    task.write_text(STALLING_TASK)
    cmd = [sys.executable, "-m", "shardplug", "train", "--task", f"{task}:task", "--quiet",
           "--steps", "10", "--devices", "2", *args]  # fmt: skip
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_data_timeout_ends_a_stalled_run_in_one_line(tmp_path):
    run = train(tmp_path, "--data-timeout", "2")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "shardplug: error: no batch 3 after 2 s: the task's data stopped producing batches"
        )
    )


def test_sigterm_while_waiting_for_data_saves_and_exits(tmp_path):
    """A scheduler's preemption notice arrives while the data hangs: the steps already taken
    are saved and the run exits 128 + SIGTERM within seconds (before, it was ignored)."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    run = train(tmp_path, "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics),
                "--log-every", "1")  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # steps 0 and 1 logged; step 2 in flight, then stall
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after step 3" in err
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["3"]


def test_a_one_shot_iterator_is_refused_as_evaluation_data(make_trainer):
    import itertools

    import optax

    import shardplug
    from shardplug.loop import evaluate as evaluation

    model = shardplug.get_model("mlp")
    held_out = (b for b in model.batches(64, 1))
    with pytest.raises(shardplug.TaskError, match="eval_data is a one-shot iterator"):
        shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3),
                       data=lambda: model.batches(64, 0), eval_data=held_out)  # fmt: skip
    _, trainer = make_trainer("mlp", devices=2)
    said = r"pass a list, a shardplug\.running\.data\.Batches"
    with pytest.raises(shardplug.ConfigError, match=said):
        trainer.fit(model.batches(64, 0), 2, eval_data=held_out, eval_every=1)

    # An endless source that can be read again, without eval_steps: capped, and said.
    endless = itertools.cycle(list(itertools.islice(model.batches(64, 1), 2)))
    rows = trainer.fit(model.batches(64, 0), 2, eval_data=lambda: endless, eval_every=2)
    assert rows[-1]["eval_batches"] == evaluation.EVAL_CAP
    assert "batches" not in trainer.evaluate(list(itertools.islice(endless, 3)))  # all read


def test_a_slow_wait_outside_the_process_is_announced(capsys):
    from shardplug.running.waiting import announced

    with announced("the checkpoint write in /slow/disk", after_s=0.1):
        time.sleep(0.4)
    with announced("a quick one", after_s=5):
        pass
    assert capsys.readouterr().err.splitlines() == [
        "shardplug: waiting 0.1 s for the checkpoint write in /slow/disk",
        "shardplug: the checkpoint write in /slow/disk: done after 0 s",
    ]
