"""The optimizer's knobs (``--optimizer``, ``--weight-decay``, ``--schedule``, ``--warmup``,
``--clip-norm``...): the learning rate each schedule gives against its formula, a run with
the knobs training as the same optax transformation written by hand, the run saying its
optimizer first, a checkpoint recording it and a resumed run continuing its schedule
exactly, and every bad knob in one line."""

import json
import math
import re

import numpy as np
import optax
import pytest

import shardplug
from shardplug.cli import main
from shardplug.errors import ConfigError
from shardplug.running.checkpoint import Checkpoints
from shardplug.running.optim import Optimizer


def optimizer_line(err):
    """The run's line saying its optimizer, among its first two (after the devices')."""
    (line,) = [x for x in err.splitlines()[:2] if x.startswith("shardplug: optimizer")]
    return line


def rates(optim, steps):
    rate = optim.learning_rate()
    return [float(rate(s)) if callable(rate) else rate for s in steps]


def test_each_schedule_gives_its_formula():
    lr, warm, ends = 1e-3, 10, 110
    cosine = Optimizer("adamw", lr, schedule="cosine", warmup=warm, decay_steps=ends)
    got = rates(cosine, [0, 5, 10, 60, 110, 200])
    want = [0.0, lr / 2, lr, lr * 0.5 * (1 + math.cos(math.pi * 50 / 100)), 0.0, 0.0]
    np.testing.assert_allclose(got, want, atol=1e-9)
    linear = Optimizer("adam", lr, schedule="linear", warmup=warm, decay_steps=ends, end_lr=1e-4)
    np.testing.assert_allclose(rates(linear, [10, 60, 110]), [lr, (lr + 1e-4) / 2, 1e-4],
                               rtol=1e-6)  # fmt: skip
    # warmup-stable-decay: stable to step 88 (the last 20% of 110 steps decays), then a line
    wsd = Optimizer("adam", lr, schedule="wsd", warmup=warm, decay_steps=ends)
    np.testing.assert_allclose(rates(wsd, [5, 10, 50, 88, 99, 110]),
                               [lr / 2, lr, lr, lr, lr / 2, 0.0], atol=1e-9)  # fmt: skip
    assert rates(Optimizer("sgd", 0.1), [0, 1000]) == [0.1, 0.1]
    warmed = Optimizer("sgd", 0.1, warmup=4)
    np.testing.assert_allclose(rates(warmed, [0, 2, 4, 9]), [0.0, 0.05, 0.1, 0.1], atol=1e-9)


def test_without_knobs_the_optimizers_are_what_they_were():
    grads = {"w": np.arange(6.0).reshape(2, 3)}
    params = {"w": np.ones((2, 3))}
    for made, before in ((Optimizer("adam", 1e-3), optax.adam(1e-3)),
                         (Optimizer("adamw", 1e-4), optax.adamw(1e-4))):  # fmt: skip
        got = made.build().update(grads, made.build().init(params), params)[0]
        want = before.update(grads, before.init(params), params)[0]
        np.testing.assert_array_equal(got["w"], want["w"])


def test_the_knobs_train_as_the_same_optax_written_by_hand():
    model = shardplug.get_model("transformer")
    knobs = Optimizer("adamw", 3e-3, weight_decay=0.01, schedule="cosine", warmup=2,
                      decay_steps=6, clip_norm=0.5)  # fmt: skip
    by_hand = optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 6, 0.0), weight_decay=0.01),
    )
    got, want = [], []
    for optimizer, out in ((knobs.build(), got), (by_hand, want)):
        task = model.task("nnx", optimizer=optimizer)
        run = task.trainer(strategy="fsdp", devices=2, precision="float32")
        out += [r["loss"] for r in run.fit(task.batches(), 4)]
    assert got == want


def test_a_run_says_its_optimizer_records_it_and_resumes_its_schedule_exactly(tmp_path, capsys):
    knobs = ["--optimizer", "adamw", "--weight-decay", "0.05", "--schedule", "wsd", "--warmup",
             "2", "--clip-norm", "1", "--lr", "0.01"]  # fmt: skip
    common = ["train", "--model", "mlp", "--devices", "2", "--log-every", "1"]
    whole, parts, ckpt = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl", tmp_path / "c"
    assert main([*common, *knobs, "--steps", "8", "--metrics-out", str(whole)]) == 0
    first = optimizer_line(capsys.readouterr().err)
    assert first == ("shardplug: optimizer adamw, lr 0.01 (warmup 2 steps, then stable, then "
                     "linear to 0 over steps 6 to 8), weight decay 0.05, gradient clipped at "
                     "global norm 1")  # fmt: skip
    # cut short at step 4 (its schedule the 8-step run's), then resumed to step 8
    saving = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--decay-steps", "8"]
    assert main([*common, *knobs, "--steps", "4", *saving]) == 0
    config = Checkpoints(ckpt).read_meta(4)["config"]
    assert {k: config[k] for k in ("optimizer", "weight_decay", "schedule", "warmup",
                                   "decay_steps", "clip_norm")} == {
        "optimizer": "adamw", "weight_decay": 0.05, "schedule": "wsd", "warmup": 2,
        "decay_steps": 8, "clip_norm": 1.0,
    }  # fmt: skip
    capsys.readouterr()
    resume = ["train", "--resume", "--checkpoint-dir", str(ckpt), "--log-every", "1"]
    assert main([*resume, "--steps", "8", "--metrics-out", str(parts)]) == 0
    assert optimizer_line(capsys.readouterr().err) == first
    read = lambda f: [json.loads(x)["loss"] for x in f.read_text().splitlines()]  # noqa: E731
    # the schedule's step count restored with the state (a warmup begun again, or the decay
    # moved, would move these by far more)
    np.testing.assert_allclose(read(parts), read(whole)[4:], rtol=1e-6)
    assert main([*resume, "--steps", "9", "--warmup", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardplug: error: --warmup 3: the run in {ckpt} was trained with warmup 2, and a "
        "resumed run continues its optimizer and schedule: drop --warmup, or train anew in "
        "another --checkpoint-dir"
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weight-decay", "0.1"], "--weight-decay is adamw's (decoupled weight decay); adam "
                                    "has none: give --optimizer adamw, or drop --weight-decay"),
        (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is sgd's; adamw keeps its "
                                                        "own moments: drop it"),
        (["--schedule", "cosine", "--warmup", "100", "--steps", "50"],
         "a cosine schedule decays from the end of its warmup (100 steps) to step 50: give more "
         "--steps (or --decay-steps) than --warmup"),
        (["--clip-norm", "0"], "--clip-norm must be a positive number, got 0.0"),
        (["--warmup", "-1"], "--warmup must be 0 or more steps, got -1"),
        (["--end-lr", "0.1"], "--end-lr is where a decaying --schedule ends; constant has none"),
        (["--schedule", "linear", "--end-lr", "1", "--lr", "0.1"],
         "--end-lr 1.0 is above --lr 0.1: a decay falls"),
        (["--task", "examples/tasks/llama.py:task", "--clip-norm", "1"],
         "--model, --clip-norm set the reference model; --task examples/tasks/llama.py:task "
         "brings its own model, optimizer and data: drop them"),
    ],
)  # fmt: skip
def test_a_bad_knob_is_one_line(flags, message, capsys):
    assert main(["train", "--model", "mlp", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"shardplug: error: {message}"]


def test_a_bad_knob_from_python_is_a_typed_error():
    with pytest.raises(ConfigError, match="optimizer must be one of adam, adamw, sgd, got 'lamb'"):
        Optimizer("lamb")


def test_a_resume_refuses_to_run_past_its_schedules_end_or_to_change_a_default_knob(
    tmp_path, capsys
):
    ckpt = tmp_path / "c"
    common = ["train", "--model", "mlp", "--devices", "2", "--quiet"]
    assert main([*common, "--schedule", "cosine", "--steps", "2", "--checkpoint-dir",
                 str(ckpt), "--checkpoint-every", "2"]) == 0  # fmt: skip
    capsys.readouterr()
    resume = ["train", "--resume", "--checkpoint-dir", str(ckpt)]
    assert main([*resume, "--steps", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardplug: error: --steps 4: the run in {ckpt} has a cosine schedule that ends at "
        "step 2 (its first run's --steps); the steps after it would train at --end-lr 0: give "
        "--steps 2, or train anew with --decay-steps"
    ]
    assert main([*resume, "--steps", "2", "--clip-norm", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardplug: error: --clip-norm 1.0: the run in {ckpt} was trained with the default "
        "clip norm, and a resumed run continues its optimizer and schedule: drop --clip-norm, "
        "or train anew in another --checkpoint-dir"
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": None}, "--lr must be a number, got None"),
        ({"warmup": 2.5}, "--warmup must be a whole number of steps, got 2.5"),
        ({"decay_steps": 5}, "--decay-steps is where a decaying --schedule ends; constant has"),
        ({"schedule": "wsd", "warmup": 9, "decay_steps": 10},
         "a wsd schedule falls over its last 2 steps (20% of 10), from step 8; a --warmup of 9"),
    ],
)  # fmt: skip
def test_from_python_each_bad_value_is_a_typed_error(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Optimizer("adam", **{"lr": 1e-3, **options})
