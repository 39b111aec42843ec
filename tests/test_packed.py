"""Packed documents that do not see each other: the packer writes each token's document
(``segment_ids``) and its place in it (``positions``); ``shardplug.attention`` keeps each
query to its own document in XLA's path and in cp's ring and gather; the rotary positions
restart at each document. A packed row scores each document as it scores alone."""

import functools

import jax
import numpy as np
import pytest

import shardplug
from shardplug import pretrained
from shardplug.errors import ConfigError
from shardplug.pretrained.text import Packed

LLAMA = "tests/fixtures/hf/llama"
LENGTHS = (5, 9, 6)  # three documents in one row of 20 tokens: 19 read, 17 targets counted


@functools.cache
def task(framework="nnx"):
    return pretrained.load(LLAMA).task(framework)


def documents(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, n).astype(np.int32) for n in LENGTHS]


def packed(docs):
    """Two rows of the documents packed as the packer packs them."""
    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)]).astype(np.int32)
    row = Packed(np.concatenate(docs), owner, sum(LENGTHS) - 1)[0]
    return {k: np.stack([v, v]) for k, v in row.items()}


@functools.cache
def alone(framework="nnx"):
    """Each document's loss in a row of its own, weighed by its targets: the packed rows'."""
    run = task(framework).trainer(strategy="dp", devices=1, precision="float32")
    total = 0.0
    for doc in documents():
        logits = np.asarray(run.model(doc[None, :-1]), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        log_p = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        total -= log_p[np.arange(len(doc) - 1), doc[1:]].sum()
    return total / sum(n - 1 for n in LENGTHS)


def test_the_packer_writes_each_tokens_document_and_place():
    owner = np.array([0] * 5 + [1] * 3 + [2] * 7 + [3] * 5, np.int32)
    rows = Packed(np.arange(20, dtype=np.int32), owner, 6)
    assert [r["segment_ids"].tolist() for r in (rows[0], rows[1])] == [
        [0, 0, 0, 0, 0, 1],
        [0, 0, 1, 1, 1, 1],
    ]
    assert rows[1]["positions"].tolist() == [1, 2, 0, 1, 2, 3]  # a document's place runs on
    assert rows[1]["loss_mask"].tolist() == [1, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("framework", "strategy", "options", "devices"),
    [("nnx", "dp", {}, 2), ("nnx", "fsdp+tp", {}, 4), ("nnx", "fsdp+cp", {}, 4),
     ("nnx", "fsdp+cp", {"attention": "gather"}, 4), ("nnx", "cp", {"balance": "none"}, 4),
     ("linen", "fsdp+cp", {}, 4), ("equinox", "fsdp+cp", {}, 4)],
)  # fmt: skip
def test_a_packed_row_scores_each_document_as_alone(framework, strategy, options, devices):
    run = task(framework).trainer(strategy=shardplug.get_strategy(strategy, **options),
                                  devices=devices, precision="float32")  # fmt: skip
    got = run.evaluate(iter([packed(documents())]))["lm_loss"]
    assert got == pytest.approx(alone(framework), rel=1e-5)


def test_changing_one_document_leaves_the_others_logits_to_the_bit():
    run = task().trainer(strategy="dp", devices=1, precision="float32")
    docs = documents()
    changed = [docs[0], documents(seed=1)[1], docs[2]]

    def logits(ds):
        batch = packed(ds)
        return np.asarray(run.model(batch["tokens"][:, :-1], segment_ids=batch["segment_ids"],
                                    positions=batch["positions"]))  # fmt: skip

    before, after = logits(docs), logits(changed)
    first, third = slice(0, LENGTHS[0]), slice(LENGTHS[0] + LENGTHS[1], None)
    np.testing.assert_array_equal(before[:, first], after[:, first])
    np.testing.assert_array_equal(before[:, third], after[:, third])
    assert not np.array_equal(before[:, LENGTHS[0]], after[:, LENGTHS[0]])


def test_segment_ids_of_another_shape_are_refused():
    q = jax.numpy.zeros((2, 8, 4, 16))
    with pytest.raises(ConfigError, match=r"segment_ids \(2, 7\) must be \(batch, sequence\) = "
                       r"\(2, 8\)"):  # fmt: skip
        shardplug.attention(q, q, q, causal=True, segment_ids=np.zeros((2, 7), np.int32))


def test_under_pp_packed_documents_are_said_to_see_each_other():
    run = task().trainer(strategy=shardplug.get_strategy("pp", schedule="gpipe"), devices=2,
                         precision="float32")  # fmt: skip
    with pytest.warns(shardplug.errors.ShardplugWarning, match="packed documents under pp"):
        run.evaluate(iter([packed(documents())]))
