"""Multi-process runs for real: ``shardplug launch`` starts 2 processes x 4 simulated CPU
devices that join one ``jax.distributed`` job (gloo collectives over loopback)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optax
import pytest

import shardplug
from shardplug.cli import main

ENV = {**os.environ, "SHARDPLUG_PLUGINS": "", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
STEPS = 10


def launch(*train_args: str, nprocs: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardplug", "launch", "--nprocs", str(nprocs),
           "--devices-per-proc", "4", "--", "train", "--quiet", *train_args]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def one_process_losses(strategy, model_name, steps, **kwargs):
    model = shardplug.get_model(model_name)
    trainer = shardplug.Trainer(
        model.adapter("nnx"),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=strategy,
        **kwargs,
    )
    return trainer, [r["loss"] for r in trainer.fit(model.batches(model.batch_size, 0), steps)]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gloo_lines_written_at_once_by_two_threads_are_not_relayed():
    """Gloo's threads write their connection lines at once: one line may hold two halves and
    the next the rest (a 2d launch under load passed one on)."""
    import io
    import threading

    from shardplug.running.launch import _stream

    lines = [
        "[Gloo] Rank 0 is connected to [Gloo] Rank 13 is connected to 3 peer ranks. Expected "
        "number of connected peer ranks is : 3\n",
        " peer ranks. Expected number of connected peer ranks is : 3\n",
        "[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks "
        "is : 3\n",
        # three threads at once, their pieces mixed (a pmap launch on a loaded machine)
        "[Gloo] Rank 0[Gloo] Rank  is connected to 17 is connected to  peer ranks. Expected "
        "number of connected peer ranks is : 7\n",
        "3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
        "Expected number of connected peer ranks is : 7\n",
        "42\n",  # the program's own, though only digits
        "shardplug: trained\n",
    ]
    lines.append("[Gloo] Rank 0 is connected to 1 peer ranks. " + "7" * 40 + "x\n")  # not
    # gloo's (a letter of its own), and read at once, not by backtracking for minutes
    out, held, said = io.StringIO(), [], []
    _stream(0, io.StringIO("".join(lines)), out, threading.Lock(), held, said)
    assert out.getvalue().splitlines()[:2] == ["[0] 42", "[0] shardplug: trained"]
    assert out.getvalue().splitlines()[2].endswith("7x") and said == [True]


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "2d", "pmap"])
def test_two_processes_train_like_one(strategy, tmp_path):
    out = tmp_path / "m.jsonl"
    done = launch("--strategy", strategy, "--model", "mlp", "--steps", str(STEPS), "--seed", "0",
                  "--metrics-out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    # process 0 alone writes the metrics and the summary; every line is prefixed by its rank
    written = rows(out)
    assert [r["step"] for r in written] == list(range(STEPS))
    summary = [line for line in done.stdout.splitlines() if "shardplug: trained" in line]
    assert len(summary) == 1 and summary[0].startswith("[0] ")
    assert "[Gloo]" not in done.stdout  # gloo's line per connection is not passed on
    assert f"with {strategy} on 8 cpu devices in 2 processes" in summary[0]
    _, want = one_process_losses(strategy, "mlp", STEPS)
    np.testing.assert_allclose([r["loss"] for r in written], want, rtol=1e-4)


def test_a_pipeline_over_two_processes_trains_like_one(tmp_path):
    """pp+dp with its stages inside each process and the data axis across the two."""
    args = ["--strategy", "pp+dp", "--mesh", "stage=4,data=2", "--model", "transformer",
            "--layers", "4", "--steps", str(STEPS), "--seed", "0"]  # fmt: skip
    out, ref = tmp_path / "m.jsonl", tmp_path / "ref.jsonl"
    done = launch(*args, "--metrics-out", str(out))
    assert done.returncode == 0, done.stdout[-3000:]
    assert main(["train", "--quiet", *args, "--metrics-out", str(ref)]) == 0
    got, want = rows(out), rows(ref)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-4)


def test_two_processes_each_read_half_of_a_pretrained_checkpoint():
    """Under fsdp over 2 processes x 4 devices each process reads its own devices' blocks:
    half of every tensor (the fixture's sizes all split over 8), and trains from them."""
    fixture = Path(__file__).parent / "fixtures" / "hf" / "mistral"
    done = launch("--init-from", str(fixture), "--strategy", "fsdp", "--steps", "1")
    assert done.returncode == 0, done.stdout[-3000:]
    read = sorted(line.split(" shardplug: ")[0] + " " + line.split("read ")[1].split(" in ")[0]
                  for line in done.stdout.splitlines() if "shardplug: read " in line)  # fmt: skip
    assert read == ["[0] 49.8 kB of the 98.9 kB", "[1] 49.8 kB of the 98.9 kB"], read
    assert "with fsdp on 8 cpu devices in 2 processes" in done.stdout


def training_launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, list[int]]:
    """A launch of an endless run, once its first metrics are written; and its workers."""
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "shardplug", "launch", "--nprocs", "2", "--devices-per-proc",
           "4", "--", "train", "--model", "mlp", "--steps", "1000000", "--log-every", "1",
           "--metrics-out", str(metrics), "--quiet", *extra]  # fmt: skip
    launcher = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()):
        if time.monotonic() > deadline:
            launcher.kill()
            pytest.fail("training never started")
        time.sleep(0.1)
    return launcher, _children(launcher.pid)


def test_killing_a_worker_ends_the_launch_and_leaves_no_worker(tmp_path):
    launcher, workers = training_launch(tmp_path)
    try:
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "shardplug: error: process 1 was killed by SIGKILL; stopped the others" in err
    assert "Traceback" not in err
    assert not any(_alive(pid) for pid in workers)


def test_ctrl_c_reaches_every_worker_which_save_and_stop(tmp_path):
    ckpt = tmp_path / "ckpt"
    launcher, workers = training_launch(tmp_path, "--checkpoint-dir", str(ckpt))
    try:
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, out[-2000:] + err[-2000:]
    stopped = [line for line in out.splitlines() if "stopped by SIGINT after step" in line]
    assert len(stopped) == 2  # both processes finished their step and saved it together
    steps = {int(line.split("after step ")[1].split(";")[0]) for line in stopped}
    assert len(steps) == 1
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == sorted(steps)
    assert not any(_alive(pid) for pid in workers)


def test_checkpoints_move_between_process_counts(tmp_path):
    """Saved by 2 processes, resumed by 1 (8 devices); saved by 1, resumed by 2."""
    _, want = one_process_losses("fsdp", "cnn", 8)
    two = tmp_path / "two"
    done = launch("--strategy", "fsdp", "--model", "cnn", "--steps", "4",
                  "--checkpoint-dir", str(two))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    model = shardplug.get_model("cnn")
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(model.learning_rate),
        strategy="2d", checkpoint_dir=two,
    )  # fmt: skip
    assert trainer.restore() == 4
    resumed = trainer.fit(model.batches(model.batch_size, 0, start=4), 4)
    np.testing.assert_allclose([r["loss"] for r in resumed], want[4:], rtol=1e-4)

    one = tmp_path / "one"
    assert main(["train", "--strategy", "dp", "--model", "cnn", "--steps", "4", "--quiet",
                 "--checkpoint-dir", str(one)]) == 0  # fmt: skip
    out = tmp_path / "m.jsonl"
    done = launch("--resume", "--checkpoint-dir", str(one), "--strategy", "pmap", "--steps", "8",
                  "--metrics-out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    np.testing.assert_allclose([r["loss"] for r in rows(out)], want[4:], rtol=1e-4)


BAD = [
    (["launch", "--nprocs", "2", "--", "strategies"], "give the command to run after --"),
    (["launch", "--nprocs", "2", "--", "train", "--devices", "8"], "launch sets --devices"),
    (["train", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "coordinator 'localhost' is not HOST:PORT"),
    (["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1, got 2"),
    (["train", "--coordinator", "127.0.0.1:1234"],
     "give --coordinator, --num-processes and --process-id together"),
    (["train", "--coordinator", "127.0.0.1:1234", "--num-processes", "3", "--process-id", "0"],
     "the 8 simulated CPU devices do not split over --num-processes 3: pass --devices N"),
    (["train", "--distributed", "--num-processes", "2"], "give either --distributed or"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_multiprocess_input_is_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardplug: error: ") and message in err[0]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


FAILING_TASK = """
import os, jax, optax, shardplug

if os.environ.get("FAIL_AT_IMPORT") and jax.process_index() == 1:
    raise ImportError("no module named 'my_dataset'")

def task(fail):
    model = shardplug.get_model("mlp")
    if fail == "building" and jax.process_index() == 1:
        raise FileNotFoundError("vocab.json")

    def data():
        for i, batch in enumerate(model.batches(model.batch_size, 0)):
            if i == 3 and jax.process_index() == 1:
                if fail == "raises":
                    raise OSError("the data server went away")
                if fail == "exits":
                    os._exit(0)  # gone without a word, as a user's sys.exit(0) would
                return  # this process's data ends early
            yield batch

    return shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3), data)

def raises():
    return task("raises")

def ends():
    return task("ends")

def exits():
    return task("exits")

def building():
    return task("building")
"""


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("raises", "the data server went away"),
        ("ends", "batches ran out after 3 of 40 steps"),
        ("building", "FileNotFoundError: vocab.json"),
        ("import", "no module named 'my_dataset'"),
    ],
)
def test_a_failed_worker_ends_the_job_within_seconds(name, why, tmp_path, monkeypatch):
    """Process 1 fails at import, while building its task, or when its data raises (or ends)
    at batch 3: it says so in one line and exits; process 0, waiting for it (in the step's
    collectives, say), stops within a second naming it; the launcher names the first
    failure and exits non-zero. Before, all three waited forever, or 30 s and more."""
    task = tmp_path / "failing.py"
    task.write_text(FAILING_TASK)
    if name == "import":
        monkeypatch.setitem(ENV, "FAIL_AT_IMPORT", "1")
    start = time.monotonic()
    spec = f"{task}:{'raises' if name == 'import' else name}"
    done = launch("--task", spec, "--steps", "40", "--strategy", "fsdp", timeout=120)
    elapsed = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "[1] shardplug: error: " in out and why in out
    assert "[0] shardplug: error: process 1 failed (" in out
    assert "shardplug: error: process 1 exited with code" in done.stderr.splitlines()[-1]
    assert "Traceback" not in out and elapsed < 60, (elapsed, out[-3000:])
    runtime = re.compile(r"\[\d\] ([IWEF]\d{4} |\*\*\* Check failure|\s+@\s+0x)")
    native = [line for line in out.splitlines() if runtime.match(line)]
    assert not native, native[:5]  # the runtime's abort of the survivors is not relayed


def test_a_worker_that_exits_early_without_a_word_ends_the_job(tmp_path):
    """Process 1 exits with 0 at batch 3 while process 0 waits for it in a collective: the
    launcher gives the others EARLY_EXIT_S, then stops them, blaming process 1."""
    from shardplug.running.launch import EARLY_EXIT_S

    task = tmp_path / "failing.py"
    task.write_text(FAILING_TASK)
    start = time.monotonic()
    done = launch("--task", f"{task}:exits", "--steps", "40", "--strategy", "fsdp", timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "shardplug: error: process 1 exited with code 0; stopped the others"
    )
    assert "while the others were still running" in done.stderr
    assert EARLY_EXIT_S < elapsed < EARLY_EXIT_S + 40


def test_a_coordinator_nobody_serves_is_announced_then_given_up():
    """Process 1 of a job whose process 0 never started: after JOIN_NOTICE_S a line names the
    address it waits for; at the join timeout it fails naming it (it was silent for 90 s+)."""
    from shardplug.running.launch import free_port

    port = free_port()
    code = (
        "from shardplug.running.distributed import initialize\n"
        f"initialize('127.0.0.1:{port}', 2, 1, local_cpu_devices=1, join_timeout_s=8)"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert (
        f"shardplug: waiting for the coordinator at 127.0.0.1:{port} (process 1 of 2); giving up "
        "after 8 s"
    ) in done.stderr
    assert f"could not join the multi-process job at 127.0.0.1:{port} within 8 s" in done.stderr
    assert elapsed < 40


def test_a_second_ctrl_c_stops_every_worker_at_once(tmp_path):
    launcher, workers = training_launch(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"))
    try:
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.2)
        start = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        launcher.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT
    assert elapsed < 5 and not any(_alive(pid) for pid in workers)


def test_on_a_gpu_machine_each_worker_gets_its_block_of_gpus(monkeypatch):
    """launch on 8 GPUs with 2 processes: GPUs 0-3 and 4-7, no simulated --devices; without
    GPUs, CPU devices as before; a count that does not split is one line."""
    from shardplug.core.devices import nvidia_gpus
    from shardplug.errors import ConfigError
    from shardplug.running.launch import gpu_blocks, worker_command

    assert gpu_blocks(2, 8) == ["0,1,2,3", "4,5,6,7"] and gpu_blocks(2, 0) is None
    with pytest.raises(ConfigError, match="--nprocs 3 does not split this machine's 8 GPUs"):
        gpu_blocks(3, 8)
    assert "--devices" not in worker_command(["train"], 1, 2, None, 1234)
    assert worker_command(["train"], 1, 2, 8, 1234)[4:6] == ["--devices", "8"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert nvidia_gpus() == 4  # a worker counts the block it was given
