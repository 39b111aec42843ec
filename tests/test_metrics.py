"""shardplug.loop.metrics and flops.step_flops: the hardware columns of every row; the
TensorBoard writer; planning on abstract arrays."""

import json

import jax
import numpy as np
import optax
import pytest

import shardplug
from shardplug.cli import main
from shardplug.core.flops import step_flops
from shardplug.loop.metrics import StepFacts, peak_tflops

TRANSFORMER = shardplug.get_model("transformer")


@pytest.fixture(scope="module")
def stacks():
    """The transformer at depths 2 and 4 under fsdp, compiled (shared by the tests)."""
    made = {}
    for layers in (2, 4):
        trainer = shardplug.Trainer(
            TRANSFORMER.adapter("nnx", layers=layers), loss_fn=TRANSFORMER.loss_fn,
            optimizer=optax.adam(1e-3), strategy="fsdp", log_every=3,
            flops_per_sample=TRANSFORMER.flops_per_sample(layers=layers), peak_tflops=0.5,
        )  # fmt: skip
        made[layers] = trainer
    return made


def test_the_step_count_follows_the_depth_where_xla_counts_a_loop_once(stacks):
    batch = next(TRANSFORMER.batches(32))
    counted, xla = {}, {}
    for layers, trainer in stacks.items():
        trainer.compile(batch)
        counted[layers] = step_flops(trainer.jaxpr)
        cost = trainer.compiled.cost_analysis()
        xla[layers] = (cost[0] if isinstance(cost, list) else cost)["flops"]
        textbook = TRANSFORMER.flops_per_sample(layers=layers) * 32
        # the textbook halves causal attention and skips the embedding gather; the step
        # computes the whole attention square
        assert 1.0 <= counted[layers] / textbook < 1.06
    assert xla[4] / xla[2] < 1.01  # XLA: the layer stack's body once, whatever its depth
    want = TRANSFORMER.flops_per_sample(layers=4) / TRANSFORMER.flops_per_sample(layers=2)
    assert counted[4] / counted[2] == pytest.approx(want, rel=0.02)


def test_rows_carry_flops_mfu_memory_and_communication(stacks):
    trainer = stacks[2]  # made with peak_tflops=0.5
    rows = trainer.fit(TRANSFORMER.batches(32), steps=3)
    row = rows[-1]
    facts = StepFacts.of(trainer.program, 8)
    assert row["step_tflops"] == pytest.approx(facts.flops / row["step_time"] / 1e12)
    model = TRANSFORMER.flops_per_sample(layers=2) * row["samples_per_sec"] / 1e12
    assert row["model_tflops"] == pytest.approx(model)
    assert row["mfu"] == pytest.approx(row["model_tflops"] / (0.5 * 8))
    # the CPU backend keeps no memory statistics: the compiled step's analysis
    analysis = trainer.compiled.memory_analysis()
    assert row["memory_in_use"] == analysis.argument_size_in_bytes
    assert row["memory_peak"] >= row["memory_in_use"] > 0
    assert 0.0 < row["comm_share"] < 1.0  # fsdp gathers and reduces every step


def test_one_device_communicates_nothing_and_a_cpu_has_no_known_peak():
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(
        model.adapter(), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3), devices=1
    )
    row = trainer.fit(model.batches(64), steps=2)[-1]
    assert row["comm_share"] == 0.0
    assert "mfu" not in row and peak_tflops(jax.devices()[0]) is None


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, out = tmp_path / "tb", tmp_path / "rows.jsonl"
    argv = ["train", "--model", "mlp", "--steps", "6", "--log-every", "3", "--tensorboard",
            str(board), "--metrics-out", str(out), "--peak-tflops", "2", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "step_time", "model_tflops", "mfu", "memory_peak", "comm_share"} <= tags
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(6))
    np.testing.assert_allclose([e.value for e in losses], [r["loss"] for r in written], rtol=1e-6)


def test_a_planning_trainer_allocates_nothing_and_explains_like_a_real_one():
    from shardplug.planning.explain import explain

    def trainer(allocate):
        return shardplug.Trainer(
            TRANSFORMER.adapter("nnx"), loss_fn=TRANSFORMER.loss_fn, optimizer=optax.adam(1e-3),
            strategy="fsdp+tp", allocate=allocate,
        )  # fmt: skip

    batch = next(TRANSFORMER.batches(32))
    before = jax.live_arrays()  # held, so their ids stay theirs; others may be freed meanwhile
    planned = trainer(False)
    plan = explain(planned, batch)
    known = {id(x) for x in before}
    new = [x for x in jax.live_arrays() if id(x) not in known]
    assert not new  # not one parameter, key or count on a device
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(planned.state))
    real = explain(trainer(True), batch)
    assert plan.per_device == real.per_device
    with pytest.raises(shardplug.ConfigError, match="allocate=False"):
        planned.fit([batch], 1)


def test_a_llama_shaped_task_plans_its_bytes_by_the_textbook():
    from pathlib import Path

    from shardplug.planning.explain import explain

    path = Path(__file__).resolve().parent.parent / "examples" / "tasks" / "llama.py"
    task = shardplug.load_task(f"{path}:tiny")
    trainer = shardplug.Trainer(task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer,
                                strategy="fsdp", allocate=False)  # fmt: skip
    report = explain(trainer, next(iter(task.batches())))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.state.params))
    bytes_ = report.per_device
    # float32 parameters split over 8 devices, Adam's two moments, a gradient like them
    assert bytes_["params_bytes"] == pytest.approx(count * 4 / 8, rel=0.05)
    assert bytes_["opt_state_bytes"] == pytest.approx(2 * bytes_["params_bytes"], rel=1e-3)
    assert bytes_["grads_bytes"] == bytes_["params_bytes"]
