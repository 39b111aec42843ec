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


MIXTRAL = "tests/fixtures/hf/mixtral"


@functools.cache
def task(framework="nnx", where=LLAMA):
    return pretrained.load(where).task(framework)


def documents(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, n).astype(np.int32) for n in LENGTHS]


def packed(docs, orders=((0, 1, 2), (0, 1, 2))):
    """Rows of the documents packed as the packer packs them, each row's in its order (rows
    of other orders: other ids and places, the same documents to score)."""

    def one(order):
        ds = [docs[i] for i in order]
        owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(ds)]).astype(np.int32)
        return Packed(np.concatenate(ds), owner, sum(LENGTHS) - 1)[0]

    rows = [one(order) for order in orders]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


#: four rows, each its own order: a microbatch given another's ids or places scores wrong
ORDERS = ((0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1))


@functools.cache
def alone(framework="nnx", where=LLAMA):
    """Each document's loss in a row of its own, weighed by its targets: the packed rows'."""
    run = task(framework, where).trainer(strategy="dp", devices=1, precision="float32")
    total = 0.0
    for doc in documents():
        out = run.model(doc[None, :-1])
        logits = np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)[0]
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
     ("linen", "fsdp+cp", {}, 4), ("equinox", "fsdp+cp", {}, 4), ("linen", "dp", {}, 2),
     ("equinox", "dp", {}, 2), ("nnx", "pp+fsdp", {"min_size": 0}, 4),
     ("linen", "pp+fsdp", {"min_size": 0}, 4), ("equinox", "pp+fsdp", {"min_size": 0}, 4),
     ("nnx", "pp+cp", {}, 4), ("linen", "fsdp+tp", {}, 4), ("equinox", "fsdp+tp", {}, 4),
     ("linen", "fsdp+cp", {"attention": "gather"}, 4),
     ("equinox", "fsdp+cp", {"attention": "gather"}, 4), ("mixtral", "fsdp+ep", {}, 4),
     ("mixtral", "cp+ep", {"cp.scheme": "ulysses"}, 4)],
)  # fmt: skip
def test_a_packed_row_scores_each_document_as_alone(framework, strategy, options, devices):
    """Mixtral's rows: NNX, its experts split (ep), as dropless as alone."""
    where = MIXTRAL if framework == "mixtral" else LLAMA
    framework = "nnx" if framework == "mixtral" else framework
    run = task(framework, where).trainer(strategy=shardplug.get_strategy(strategy, **options),
                                         devices=devices, precision="float32")  # fmt: skip
    got = run.evaluate(iter([packed(documents(), ORDERS)]))["lm_loss"]
    assert got == pytest.approx(alone(framework, where), rel=1e-5)


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


@functools.cache
def trained(strategy="dp", mesh="data=1", framework="nnx", **options):
    """Three steps' losses on four packed rows, each of its own order: its own ids and
    places (a microbatch of one row, or two: never two alike)."""
    batch = packed(documents(), ORDERS)
    devices = int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))
    run = task(framework).trainer(strategy=shardplug.get_strategy(strategy, **options),
                                  mesh=mesh, devices=devices, precision="float32")  # fmt: skip
    return [row["loss"] for row in run.fit(iter([batch] * 3), 3)]


@pytest.mark.parametrize(
    ("strategy", "mesh", "framework", "options"),
    [("pp", "stage=2", "linen", {"schedule": "1f1b"}),
     ("pp+fsdp", "stage=2,fsdp=2", "nnx", {"pp.schedule": "zb", "min_size": 0}),
     ("dp+pp", "data=2,stage=2", "equinox", {"pp.schedule": "1f1b"}),
     ("dp+pp", "data=2,stage=2", "nnx", {"pp.schedule": "gpipe", "microbatches": 2}),
     ("pp+cp", "stage=2,context=2", "nnx", {"pp.schedule": "gpipe"})],
)  # fmt: skip
def test_under_pp_each_microbatch_trains_on_its_own_documents(strategy, mesh, framework, options):
    """The stack's rows (ids, positions) reach each microbatch's layers on every stage, in
    the schedules' passes as in gpipe's loop: the trajectory is one device's."""
    want = trained(framework=framework)
    got = trained(strategy, mesh, framework, **options)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(("causal", "balance", "length", "fused", "docs"),
                         [(True, True, 30, False, True), (False, True, 30, False, True),
                          (False, False, 31, False, True), (True, True, 30, True, True),
                          (True, False, 31, True, True), (False, False, 31, True, True),
                          (True, True, 30, True, False),
                          (False, False, 31, True, False)])  # fmt: skip
def test_the_rings_ids_go_round_with_their_keys_gradients_too(causal, balance, length, fused,
                                                              docs):  # fmt: skip
    """cp's ring alone (4 devices, a length they do not divide: padded; grouped key heads)
    against XLA's attention masked by the same ids (or none, ``docs`` False): the output and
    all three gradients; ``fused``: each block pair met by a GPU's fused kernel (in Pallas'
    interpreter here), folded by its log-sum-exp."""
    import functools

    import jax.numpy as jnp

    from shardplug.core.operations.attention import with_segments
    from shardplug.strategies.cp.ring import gathered_attention, ring_attention

    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((4,), ("context",), auto, devices=jax.devices()[:4])
    k, v = jax.random.normal(jax.random.key(0), (2, 2, length, 2, 8))
    q = jax.random.normal(jax.random.key(1), (2, length, 4, 8))
    ids = jnp.asarray(np.repeat(np.arange(length) // 7, 1)[None].repeat(2, 0))  # 7-token documents
    ids = ids if docs else None

    def loss(attend, q, k, v):
        out = attend(q, k, v, causal=causal, bias=None, mask=None, scale=None, segment_ids=ids)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    def reference(q, k, v, *, causal, bias, mask, scale, segment_ids):
        mask = None if segment_ids is None else with_segments(None, segment_ids, segment_ids)
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, mask=mask)

    want = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    ring = ring_attention("context", balance=balance, fused=fused)
    for scheme in (ring, gathered_attention("context")) if not fused else (ring,):
        with jax.set_mesh(mesh):  # the schemes pad the sequence and split it themselves
            step = jax.value_and_grad(functools.partial(loss, scheme), argnums=(0, 1, 2))
            got = jax.jit(step)(q, k, v)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_loss_takes_ids_per_token_read_or_per_token_of_the_row():
    model = task().trainer(strategy="dp", devices=1, precision="float32").model
    batch = packed(documents())
    loss_fn = task().loss_fn
    want = loss_fn(model, batch)[0].total
    row = {k: np.concatenate([batch[k], batch[k][:, -1:] + 1], 1) for k in ("segment_ids",
                                                                          "positions")}  # fmt: skip
    assert loss_fn(model, {**batch, **row})[0].total == want  # the last, never read, cut
    said = r"batch positions \(2, 17\): give \(rows, 19\), one per token the model reads, or "
    with pytest.raises(ConfigError, match=said + r"\(rows, 20\), one per token of the row"):
        loss_fn(model, {**batch, "positions": batch["positions"][:, :17]})


def reference_packed(orders=((0, 1, 2), (0, 1, 2))):
    """Packed rows for the reference transformer (its vocabulary), with targets."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50, n).astype(np.int32) for n in LENGTHS]
    row = packed(docs, orders)
    tokens = row["tokens"]
    return docs, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                  "segment_ids": row["segment_ids"], "positions": row["positions"]}  # fmt: skip


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_the_reference_transformers_learned_positions_restart_at_each_document(framework):
    """Its blocks take the ids through the stack (``rows=``), its position table is read at
    each token's place in its document: each document's logits are its logits alone."""
    model = shardplug.get_model("transformer")
    run = model.task(framework).trainer(strategy="dp", devices=1, precision="float32")
    docs, batch = reference_packed()
    got = np.asarray(run.model(batch["tokens"], segment_ids=batch["segment_ids"],
                               positions=batch["positions"]))  # fmt: skip
    start = 0
    for doc in docs:
        doc = doc[: batch["tokens"].shape[1] - start]  # the last loses its last token
        alone = np.asarray(run.model(doc[None]))[0]
        np.testing.assert_allclose(got[1, start : start + len(doc)], alone, atol=1e-5)
        start += len(doc)


@pytest.mark.parametrize(
    ("framework", "options"),
    [("nnx", {"schedule": "1f1b"}), ("linen", {"schedule": "gpipe"}),
     ("nnx", {"schedule": "interleaved-1f1b", "repeats": 2}),
     ("equinox", {"schedule": "gpipe", "repeats": 2})],
)  # fmt: skip
def test_the_reference_transformer_trains_packed_rows_under_pp_as_one_device(framework, options):
    """``shardplug.stack.apply`` and ``LinenLayers`` pass the rows on to pp's stages; the
    circular schedules (4 layers, 2 stages, 2 repeats) too."""
    model = shardplug.get_model("transformer")
    _, batch = reference_packed(ORDERS)

    def losses(strategy, devices):
        run = model.task(framework, layers=4).trainer(strategy=strategy, devices=devices,
                                                      precision="float32")  # fmt: skip
        return [row["loss"] for row in run.fit(iter([batch] * 3), 3)]

    pp = shardplug.get_strategy("pp", **options)
    np.testing.assert_allclose(losses(pp, 2), losses("dp", 1), rtol=1e-5)


def test_a_stacks_rows_of_another_batch_are_refused_in_one_line():
    params = {"w": jax.numpy.ones((2, 4, 4))}
    x = jax.numpy.ones((3, 4))
    said = r"a layer stack's rows lead with the batch's 3 rows .* 'segment_ids' has shape \(2, 4\)"
    with pytest.raises(ConfigError, match=said):
        shardplug.stack.scan(lambda w, h, segment_ids: h @ w, params, x,
                             rows={"segment_ids": np.zeros((2, 4), np.int32)})  # fmt: skip


def test_a_layer_stack_operation_without_rows_is_given_blocks_closed_over_them(monkeypatch):
    """A third party's loop written before rows (over the whole batch) still computes the
    model right, and is warned that a loop over microbatches must take them."""
    from shardplug.core import ops

    def loop(block, params, x, *, layers):
        return jax.lax.scan(lambda h, w: (block(w, h), None), x, params)[0]

    params, x = {"w": jax.numpy.eye(4)[None].repeat(2, 0)}, jax.numpy.ones((3, 4))
    ids = jax.numpy.arange(3)[:, None] * jax.numpy.ones((3, 4))

    def block(w, h, segment_ids=None):
        return h @ w["w"] + (0 if segment_ids is None else segment_ids)

    want = shardplug.stack.scan(block, params, x, rows={"segment_ids": ids})
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    with ops.override("layer_stack", loop):
        assert shardplug.stack.scan(block, params, x) is not None  # no rows: as before
        with pytest.warns(shardplug.errors.ShardplugWarning, match="takes no rows=: its blocks"):
            got = shardplug.stack.scan(block, params, x, rows={"segment_ids": ids})
    np.testing.assert_array_equal(got, want)


def _documents(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), 3, replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(length), side="right")
    return jax.numpy.asarray(ids)


@pytest.mark.parametrize("split", ["rows", "rows and heads", "per device"])
def test_the_fused_kernel_keeps_documents_apart_as_xlas_masked_attention_does(split):
    """A GPU's packed attention (Pallas' flash kernel, in its interpreter here) against XLA's
    masked attention: the output and all three gradients, with grouped key heads, its rows
    split over 8 devices (or rows and heads): each device runs the kernel on its own."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplug.core.operations import flash

    batch, length, heads, dim = 8, 256, 4, 32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, dim))
    k, v = (jax.random.normal(x, (batch, length, 2, dim)) for x in keys[1:])
    ids = _documents(batch, length)
    scale = dim**-0.5

    def masked(q, k, v):
        mask = (ids[:, :, None] == ids[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale)

    def fused(q, k, v):
        return flash.packed_attention(q, k, v, ids, causal=True, scale=scale, interpret=True)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(("data", "model")) if split == "rows" else P("data", None, "model")
    if split == "per device":  # inside an unchecked per-device program, as cp's Ulysses runs
        rows = P(("data", "model"))
        spec = rows

        def fused(q, k, v):
            return jax.shard_map(
                lambda q, k, v, ids: flash.packed_attention(q, k, v, ids, causal=True,
                                                            scale=scale, interpret=True),
                in_specs=(rows,) * 4, out_specs=rows, check_vma=False)(q, k, v, ids)  # fmt: skip

    laid = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]

    def loss(f):
        return lambda *x: jnp.sum(jnp.sin(f(*x)))

    with jax.set_mesh(mesh):
        np.testing.assert_allclose(jax.jit(fused)(*laid), masked(q, k, v), atol=2e-6)
        step = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))
        got, want = step(*laid), jax.grad(loss(masked), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6 * float(jnp.max(jnp.abs(b))))
        assert got[0].sharding.spec == spec  # the gradient stays where the queries were
        text = step.lower(*laid).compile().as_text()
    assert not any(c in text for c in ("all-gather", "all-to-all", "all-reduce"))


def test_the_pair_kernels_tiles_are_powers_of_two_that_divide_the_block():
    """Triton takes tiles of a power of two: a ring's dealt half-block of 96 positions
    (sequence 768 over 4 devices) runs in tiles of 32, of 48 in tiles of 16."""
    from shardplug.core.operations.flash_pairs import _tile

    assert [_tile(n, 64) for n in (96, 48, 80, 128, 1024, 16)] == [32, 16, 16, 64, 64, 16]
    assert _tile(96, 128) == 32


def test_what_the_fused_kernel_cannot_take_is_said():
    from shardplug.core.operations import flash

    def shaped(*shape):
        return jax.ShapeDtypeStruct(shape, np.float32)

    q = shaped(2, 256, 4, 32)
    assert flash.fits(q, q, q) is None
    assert "not a multiple of 128" in flash.fits(shaped(2, 200, 4, 32), shaped(2, 200, 4, 32),
                                                  shaped(2, 200, 4, 32))  # fmt: skip
    assert "queries of 256 and keys of 128" in flash.fits(q, shaped(2, 128, 4, 32), q)
    assert "head dimension of 8, under 16" in flash.fits(*[shaped(2, 256, 4, 8)] * 3)
    assert "4 query heads over 3 key heads" in flash.fits(q, shaped(2, 256, 3, 32),
                                                          shaped(2, 256, 3, 32))  # fmt: skip
