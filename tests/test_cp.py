"""Context parallelism: the sequence split over `context`, composed with the others, trains
like one device; its compiled step gathers keys and values and keeps the scores split."""

import functools
import itertools
import json
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardplug
from shardplug.core.compiled.hlo import collectives
from shardplug.testing.conformance import _losses, one_device_losses

STEPS = 3


@pytest.mark.parametrize(
    ("name", "mesh", "adapter"),
    [
        ("cp", None, "nnx"),
        ("dp+cp", "data=2,context=4", "nnx"),
        ("fsdp+cp", "fsdp=2,context=4", "linen"),
        ("cp+tp", "seq=4,model=2", "equinox"),  # the axis renamed: axis_names={"context": "seq"}
        ("fsdp+cp+tp", "fsdp=2,context=2,model=2", "nnx"),
        ("fsdp+cp+tp", "fsdp=2,context=2,model=2", "linen"),
        ("fsdp+cp+tp", "fsdp=2,context=2,model=2", "equinox"),
        ("pp+cp", "stage=2,context=4", "nnx"),
        ("pp+fsdp+cp+tp", "stage=2,fsdp=2,context=2,model=1", "equinox"),
    ],
)
def test_compositions_with_cp_train_like_one_device(name, mesh, adapter):
    options = {"min_size": 0} if "fsdp" in name or "tp" in name else {}
    if "seq=" in (mesh or ""):
        options["axis_names"] = {"context": "seq"}
    losses = _losses(name, options, adapter, "transformer", STEPS, 0, 8, mesh, {})
    want = one_device_losses(adapter, "transformer", STEPS, 0, ())
    np.testing.assert_allclose(losses, want, rtol=1e-4)


def _transformer_trainer(strategy, mesh, **kwargs):
    model = shardplug.get_model("transformer")
    task = model.task("nnx", **kwargs)
    return model, task.trainer(strategy=strategy, mesh=mesh)


def _dp_cp_collectives(scheme):
    model = shardplug.get_model("transformer")
    strategy = shardplug.get_strategy("dp+cp", **{"cp.attention": scheme})
    trainer = model.task("nnx").trainer(strategy=strategy, mesh="data=2,context=4")
    trainer.compile(next(model.batches(model.batch_size, 0)))
    assert trainer.batch_shardings["tokens"].spec == P("data", "context")
    return {c.kind: c for c in collectives(trainer.compiled.as_text())}


BLOCK = 16 * 8 * 4 * 16 * 4  # one device's keys (or values): rows, L/4, heads, head dim, f32


def test_the_ring_passes_each_block_context_minus_one_times_each_way():
    """dp+cp (data=2, context=4), 2 layers: forward, each layer's key and value blocks go
    round the ring 3 times; backward, their gradients come back 3 times; and the zig-zag
    deal moves queries, keys, values and output in two half blocks each, there and back
    (their gradients the other way); nothing is all-gathered but a 16 kB parameter's
    gradient."""
    found = _dp_cp_collectives("ring")
    ring, deal = 2 * 2 * 3 * 2 * BLOCK, 2 * 2 * 4 * BLOCK
    assert found["collective-permute"].bytes == ring + deal
    assert found["collective-permute"].count == 2 * 2 * 3 * 2 + 2 * 2 * 4 * 2
    assert found["all-gather"].bytes < BLOCK


@pytest.mark.parametrize(("causal", "balance"), [(True, True), (True, False), (False, True)])
def test_ring_attention_on_eight_devices_equals_attention_on_one(causal, balance):
    """The ring alone (context=8, so the deal's permutations are not their own inverses):
    outputs and the gradients of all three inputs as jax.nn.dot_product_attention's."""
    import jax

    from shardplug.strategies.cp.ring import ring_attention

    mesh = jax.make_mesh((8,), ("context",), devices=jax.devices()[:8])
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 2, 8))
    ring = ring_attention("context", balance=balance)

    def loss(attend, q, k, v):
        out = attend(q, k, v, causal=causal, bias=None, mask=None, scale=None)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    def reference(q, k, v, causal, bias, mask, scale):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    want = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    with jax.set_mesh(mesh):
        split = jax.sharding.NamedSharding(mesh, P(None, "context"))
        args = [jax.device_put(x, split) for x in (q, k, v)]
        got = jax.jit(jax.value_and_grad(functools.partial(loss, ring), argnums=(0, 1, 2)))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_gather_scheme_gathers_keys_and_values_once_per_layer():
    """The same with attention="gather": each layer's keys and values all-gathered (4 x the
    block), nothing of the size of the scores, no ring."""
    found = _dp_cp_collectives("gather")
    keys_values = 2 * 2 * 4 * BLOCK
    assert keys_values <= found["all-gather"].bytes <= keys_values * 1.05, found
    assert "collective-permute" not in found


def test_a_batch_without_a_sequence_is_one_line_and_nothing_else():
    """An MLP's (rows, 16) features and a classifier's labels are no sequence: cp refuses in
    one line, without the warning the first trace raised (it split the features)."""
    for name, leaves in (("mlp", r"x \(64, 16\), y \(64, 1\)"), ("classifier", r"label \(64,\)")):
        model = shardplug.get_model(name)
        task = model.task("nnx")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with pytest.raises(shardplug.ConfigError, match="cp: the model has no sequence to "
                               f"split: no leaf of its batch \\(.*{leaves}"):  # fmt: skip
                task.trainer(strategy="fsdp+cp").compile(next(model.batches(64, 0)))
        assert not [w for w in said if issubclass(w.category, shardplug.ShardplugWarning)]
    with pytest.raises(shardplug.CompositionError, match="'pmap' is a whole strategy"):
        shardplug.get_strategy("pmap+cp")


def test_only_the_leaves_attention_reads_are_split_and_a_declared_one_is(monkeypatch):
    """A float leaf beside the tokens (a per-row (rows, 16) feature) is placed whole over
    `context` once the trace shows attention reads 32 positions, and the run trains like one
    device; `-o cp.sequence=x` splits an MLP's features as the user declares."""
    model = shardplug.get_model("transformer")
    batches = [
        {**b, "weight": np.full((16, 16), 0.5 + i, np.float32)}
        for i, b in enumerate(itertools.islice(model.batches(16, 0), STEPS))
    ]

    def loss_fn(m, batch):
        logits = m(batch["tokens"])
        each = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return (each.mean(axis=1) * batch["weight"].mean(axis=1)).mean()

    def run(strategy, devices):
        trainer = shardplug.Trainer(
            model.adapter("nnx"), loss_fn=loss_fn, optimizer=optax.adam(1e-2),
            strategy=strategy, devices=devices,
        )  # fmt: skip
        return trainer, [r["loss"] for r in trainer.fit(batches, steps=STEPS)]

    trainer, got = run("dp+cp", 8)
    specs = {k: s.spec for k, s in trainer.batch_shardings.items()}
    assert specs["weight"] == P("data"), specs
    assert specs["targets"] == P("data", "context"), specs
    np.testing.assert_allclose(got, run("dp", 1)[1], rtol=1e-4)

    mlp = shardplug.get_model("mlp")
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    declared = shardplug.get_strategy("fsdp+cp", **{"cp.sequence": "x"})
    with pytest.warns(shardplug.ShardplugWarning, match="never called shardplug.attention"):
        trainer = mlp.task("nnx").trainer(strategy=declared)
        trainer.compile(next(mlp.batches(64, 0)))
    assert trainer.batch_shardings["x"].spec == P("fsdp", "context")
    assert trainer.batch_shardings["y"].spec == P("fsdp")
    misspelt = shardplug.get_strategy("fsdp+cp", **{"cp.sequence": "xs"})
    with pytest.raises(shardplug.ConfigError, match=r"names 'xs', which is no leaf of the batch "
                       r"\(x, y\)"):  # fmt: skip
        mlp.task("nnx").trainer(strategy=misspelt).compile(next(mlp.batches(64, 0)))


class HandWritten(nnx.Module):
    """Attention written by hand with jax.nn.dot_product_attention, not shardplug's."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.out = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)[:, :, None, :]
        x = x + jnp.asarray(jax_attention(x, x, x, is_causal=True))
        return self.out(x[:, :, 0, :])


def jax_attention(*args, **kwargs):
    import jax

    return jax.nn.dot_product_attention(*args, **kwargs)


def test_attention_written_by_hand_trains_right_and_is_said(monkeypatch):
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    model = shardplug.get_model("transformer")

    def loss_fn(m, batch):
        logits = m(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def losses(strategy, devices):
        trainer = shardplug.Trainer(
            shardplug.from_nnx(HandWritten), loss_fn=loss_fn, optimizer=optax.adam(1e-2),
            strategy=strategy, devices=devices,
        )  # fmt: skip
        return [r["loss"] for r in trainer.fit(model.batches(16, 0), steps=STEPS)]

    with pytest.warns(shardplug.ShardplugWarning, match="never called shardplug.attention"):
        got = losses("cp", 8)
    np.testing.assert_allclose(got, losses("dp", 1), rtol=1e-4)


def test_four_context_devices_hold_under_a_third_of_the_activations():
    """Compiled memory of a sequence-1024 step (nothing allocated): at context=4 a device's
    temporaries are under 0.3x those of one device, with either scheme (ring: one block pair
    of scores at a time; gather: the scores of its queries against the whole sequence)."""
    model = shardplug.get_model("transformer")
    batch = next(model.batches(4, 0, sequence=1024))
    temp = {}
    for devices in (1, 4):
        trainer = model.task("nnx", sequence=1024, batch_size=4).trainer(
            strategy="cp", devices=devices, allocate=False
        )
        trainer.compile(batch)
        temp[devices] = trainer.compiled.memory_analysis().temp_size_in_bytes
    assert temp[4] <= 0.3 * temp[1], temp


def test_the_command_line_sets_the_sequence(tmp_path):
    import json

    from shardplug.cli import main

    metrics = tmp_path / "metrics.jsonl"
    code = main(["train", "--sequence", "64", "--strategy", "dp+cp", "--steps", "2",
                 "--batch-size", "8", "--metrics", str(metrics)])  # fmt: skip
    assert code == 0
    assert len([json.loads(line) for line in metrics.read_text().splitlines()]) >= 1
    assert main(["train", "--model", "mlp", "--sequence", "64", "--steps", "1"]) == 2


LLAMA = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples/tasks/llama.py"


@functools.cache
def _llama_losses(strategy: str, mesh: str | None, devices: int) -> tuple[float, ...]:
    task = shardplug.load_task(f"{LLAMA}:long_context")
    options = {"min_size": 0} if "fsdp" in strategy or "tp" in strategy else {}
    trainer = task.trainer(
        strategy=shardplug.get_strategy(strategy, **options), mesh=mesh, devices=devices
    )
    return tuple(r["loss"] for r in trainer.fit(task.batches(), steps=2))


@pytest.mark.parametrize(
    ("name", "mesh"),
    [("fsdp+cp+tp", "fsdp=2,context=2,model=2"), ("pp+cp", "stage=2,context=4")],
)
def test_a_llama_with_rope_at_1024_trains_like_one_device(name, mesh):
    """examples/tasks/llama.py at sequence 1024 (RoPE, causal, next-token targets shifted
    before the split) on 8 devices, against one device."""
    np.testing.assert_allclose(
        _llama_losses(name, mesh, 8), _llama_losses("dp", None, 1), rtol=1e-4
    )


def test_explain_shows_cp_share_and_takes_the_ring_for_no_pipeline():
    """explain of dp+cp: no pipeline; the sequence's split and the ring's share of the step's
    traffic (its permutes: the HLO test's count and bytes)."""
    from shardplug.planning.explain import explain

    model, trainer = _transformer_trainer("dp+cp", "data=2,context=4")
    report = explain(trainer, next(model.batches(model.batch_size, 0)))
    assert report.pipeline is None
    share = report.sequence
    assert share["axes"] == ["context"] and (share["length"], share["per_device"]) == (32, 8)
    assert share["ring_permutes"] == 56 and share["ring_bytes"] == 2 * 2 * (3 * 2 + 4) * BLOCK
    assert share["ring_share"] == pytest.approx(share["ring_bytes"] / report.wire_bytes())
    assert any(n.startswith("the sequence is split over ['context']: each device holds 8 of "
                            "the 32 positions") for n in report.notes)  # fmt: skip


def test_an_unknown_attention_scheme_is_one_line():
    expected = r"scheme must be 'ring' .*'gather' .*'ulysses' .* or 'hybrid' .* got 'bogus'"
    with pytest.raises(shardplug.StrategyOptionError, match=expected):
        shardplug.get_strategy("dp+cp", **{"cp.attention": "bogus"})  # the older name
    with pytest.raises(shardplug.StrategyOptionError, match=expected):
        shardplug.get_strategy("dp+cp", **{"cp.scheme": "bogus"})
    with pytest.raises(shardplug.StrategyOptionError, match="attention is the older name"):
        shardplug.get_strategy("cp", scheme="ring", attention="gather")
    with pytest.raises(shardplug.StrategyOptionError, match=r"balance must be 'zigzag' .*'odd'"):
        shardplug.get_strategy("cp", balance="odd")


def test_recommend_finds_the_longest_sequence_cp_fits(capsys):
    """The command line end to end on the reference transformer (compiled at 256, 128 and
    192, nothing allocated): 256 is over 3 MB a device, 128 fits, and the gap is closed to
    the quarter of the start; the table shows the bracket."""
    from shardplug.cli import main
    from shardplug.planning.views import render_longest

    args = ["recommend", "--longest-sequence", "--strategies", "cp", "--sequence", "256"]
    assert main([*args, "--device-memory", "3MB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["strategies"]
    assert row["mesh"] == {"context": 8} and row["rows"] == 1
    assert [length for length, _ in row["tried"]] == [128, 192, 256]
    assert row["longest"] in (128, 192) and row["first_over"] == row["longest"] + 64
    assert row["peak_bytes"] <= 3 * 10**6 < dict(row["tried"])[row["first_over"]]
    console = Console(width=120, record=True)
    render_longest(result, console, "transformer")
    assert f"{row['longest']:,}" in console.export_text()


def test_cp_that_divides_nothing_is_refused_alike_in_train_explain_and_recommend():
    """Hand-written attention fed tokens[:, :-1] of 33 (Gemma's form): the batch's sequence
    does not split over context and nothing else would, so cp and dp+cp are refused in one
    line, by the trainer, by explain and by recommend (which takes dp)."""
    from shardplug.planning.explain import explain
    from shardplug.planning.recommend import recommend

    batch = {"tokens": np.random.default_rng(0).integers(0, 64, (16, 33)).astype(np.int32)}

    def loss_fn(m, b):
        logits = m(b["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()

    def trainer(name):
        return shardplug.Trainer(shardplug.from_nnx(HandWritten), loss_fn=loss_fn,
                                 optimizer=optax.adam(1e-2), strategy=name, devices=8)  # fmt: skip

    said = r"cp divides nothing here: no sequence of the batch splits over its \d devices " \
        r"\(tokens of 33 positions.*call shardplug.attention"  # fmt: skip
    for name in ("cp", "dp+cp"):
        with pytest.raises(shardplug.ConfigError, match=said):
            trainer(name).compile(batch)
        with pytest.raises(shardplug.ConfigError, match=said):
            explain(trainer(name), batch)

    def compiled(name):
        t = trainer(name)
        t.compile(batch)
        return t, batch

    ranked = recommend(compiled, device_memory=2**34, strategies=["dp", "cp", "dp+cp"])
    rows = {r["strategy"]: r for r in ranked["strategies"]}
    assert ranked["recommended"] == "dp"
    for name in ("cp", "dp+cp"):
        assert "cp divides nothing here" in rows[name]["error"], rows[name]
