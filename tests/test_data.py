"""shardplug.running.data: Grain batches, split by process, and resumed exactly from a
checkpoint."""

import hashlib
import itertools

import grain
import numpy as np
import pytest
from test_distributed import launch, rows

import shardplug
from shardplug.builtin_tasks import digits
from shardplug.errors import CheckpointError, ConfigError
from shardplug.running.data import Batches

RECORDS = [{"x": np.full(3, i, np.float32), "id": np.int32(i)} for i in range(40)]


def ids(batches, count):
    it = iter(batches)
    return [next(it)["id"].tolist() for _ in range(count)]


def test_batches_are_a_fixed_shuffle_each_epoch_anew():
    first = ids(Batches(RECORDS, 8, seed=3), 10)  # 5 batches an epoch
    assert first == ids(Batches(RECORDS, 8, seed=3), 10)  # deterministic
    assert first != ids(Batches(RECORDS, 8, seed=4), 10)
    epoch1 = [i for batch in first[:5] for i in batch]
    epoch2 = [i for batch in first[5:] for i in batch]
    assert sorted(epoch1) == sorted(epoch2) == list(range(40)) and epoch1 != epoch2
    assert ids(Batches(RECORDS, 8, shuffle=False), 2) == [list(range(8)), list(range(8, 16))]


def test_each_process_reads_its_own_rows_of_the_same_global_batches():
    whole = ids(Batches(RECORDS, 8, seed=1), 6)
    parts = [ids(Batches(RECORDS, 8, seed=1, process_index=p, process_count=2), 6) for p in (0, 1)]
    assert [a + b for a, b in zip(*parts, strict=True)] == whole


def test_read_ahead_is_bounded_by_bytes_and_planning_reads_batch_zero_alone(monkeypatch):
    """Grain's default read 500 batches ahead on 16 threads: 32 GB of 1M-token rows, and a
    first batch 38 s late behind them. Read-ahead now holds at most 256 MB (16 small
    batches), and planning's first batch is read with no iterator at all."""
    from shardplug.cli.config import read_first
    from shardplug.running.data import READ_AHEAD_BYTES

    small = Batches(RECORDS, 8, seed=1)
    assert small._read_options().prefetch_buffer_size == 16
    long = [{"tokens": np.zeros(1 << 20, np.int32), "targets": np.zeros(1 << 20, np.int32)}] * 8
    ahead = Batches(long, 8, shuffle=False)._read_options().prefetch_buffer_size
    assert ahead == 4 and ahead * 8 * 8 * 2**20 <= READ_AHEAD_BYTES
    halves = Batches(long, 8, process_index=0, process_count=2)._read_options()
    assert halves.prefetch_buffer_size == 8  # each process reads its half of every batch

    want = next(iter(small))
    monkeypatch.setattr(grain.MapDataset, "to_iter_dataset", None)  # no iterator made
    got = read_first(small)
    assert got["id"].tolist() == want["id"].tolist()


def test_the_state_continues_exactly_and_refuses_another_data_set():
    it = iter(Batches(RECORDS, 8, seed=1))
    ids(it, 3)
    state = it.get_state()
    assert state["grain"] == {"next_index": 3}
    resumed = iter(Batches(RECORDS, 8, seed=1))
    resumed.set_state(state)
    assert ids(resumed, 4) == ids(it, 4)
    for other in (Batches(RECORDS, 8, seed=2), Batches(RECORDS, 4, seed=1),
                  Batches(RECORDS[::-1], 8, seed=1)):  # fmt: skip
        with pytest.raises(CheckpointError, match="another data set"):
            iter(other).set_state(state)


def test_bad_batches_are_refused():
    with pytest.raises(ConfigError, match="fewer than one batch"):
        Batches(RECORDS, 64)
    with pytest.raises(ConfigError, match="does not split over 3 processes"):
        iter(Batches(RECORDS, 8, process_index=0, process_count=3))


class Seen:
    """Batches, remembering a digest of each one read; Grain's state passes through."""

    def __init__(self, batches):
        self.it, self.seen = iter(batches), []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        self.seen.append(hashlib.sha1(batch["image"].tobytes()).hexdigest())
        return batch

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state):
        self.it.set_state(state)


def digits_trainer(strategy, devices, directory=None):
    task = digits(batch_size=32)
    trainer = shardplug.Trainer(
        task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer, strategy=strategy,
        devices=devices, log_every=5, checkpoint_dir=directory,
    )  # fmt: skip
    return task, trainer


def test_a_resumed_run_reads_the_records_the_uninterrupted_one_read(tmp_path):
    task, whole = digits_trainer("dp", 8)
    data = Seen(task.data)
    want = [r["loss"] for r in whole.fit(data, 20)]
    task, first = digits_trainer("dp", 8, tmp_path)
    half = Seen(task.data)
    losses = [r["loss"] for r in first.fit(half, 10)]
    # another strategy and device count; its batches given from the start, put back by restore
    task, second = digits_trainer("fsdp", 4, tmp_path)
    assert second.restore() == 10
    assert second.restored_meta["data_state"]["grain"] == {"next_index": 10}
    rest = Seen(task.data)
    losses += [r["loss"] for r in second.fit(rest, 10)]
    assert half.seen + rest.seen == data.seen  # the same 20 batches, in order
    np.testing.assert_allclose(losses, want, rtol=1e-4)


def test_two_processes_resume_with_grain_onto_another_strategy(tmp_path):
    task = digits()  # the CLI's batch size, 64
    whole = shardplug.Trainer(task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer)
    want = [r["loss"] for r in whole.fit(task.data, 20)]
    out, ckpt = tmp_path / "m.jsonl", str(tmp_path / "ckpt")
    common = ("--task", "shardplug.builtin_tasks:digits", "--metrics-out", str(out),
              "--checkpoint-dir", ckpt)  # fmt: skip
    done = launch(*common, "--strategy", "fsdp", "--steps", "10")
    assert done.returncode == 0, done.stdout[-3000:]
    done = launch(*common, "--strategy", "dp", "--steps", "20", "--resume")
    assert done.returncode == 0, done.stdout[-3000:]
    written = rows(out)
    assert [r["step"] for r in written] == list(range(20))
    np.testing.assert_allclose([r["loss"] for r in written], want, rtol=1e-4)


def test_a_checkpoint_without_a_data_state_resumes_grain_data_at_its_step(tmp_path):
    task, first = digits_trainer("dp", 8, tmp_path)
    plain = list(itertools.islice(iter(task.data), 6))
    first.fit(plain, 4)  # a list has no state: the checkpoint holds only the step
    task, second = digits_trainer("dp", 8, tmp_path)
    assert second.restore() == 4 and "data_state" not in second.restored_meta
    seen = Seen(task.data)
    second.fit(seen, 2)
    # read past the 4 batches trained on, then trained on batches 4 and 5
    assert seen.seen == [hashlib.sha1(b["image"].tobytes()).hexdigest() for b in plain]
