"""cp's all-to-all scheme (``-o cp.scheme=ulysses``, DeepSpeed-Ulysses): the heads split over
the context axis for attention, equal to XLA's attention alone and to one device's training
composed with fsdp, tp and pp; its all-to-alls are the textbook's bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.operations.attention import with_segments
from shardplug.errors import ConfigError
from shardplug.planning.explain import explain
from shardplug.strategies.cp.ulysses import group_size, kv_repeats, ulysses_attention
from shardplug.testing.conformance import _losses, one_device_losses

STEPS = 3


def _mesh(size):
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((size,), ("context",), auto, devices=jax.devices()[:size])


def _against_xla(attend, causal, length, heads, kv_heads, packed, devices, atol):
    """``attend`` on ``devices`` against XLA's attention alone, the same ids as a mask: the
    output and all three gradients."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, length, heads, 8))
    k, v = (jax.random.normal(key, (2, length, kv_heads, 8)) for key in keys[1:])
    ids = jnp.asarray(np.arange(length)[None].repeat(2, 0) // 7) if packed else None

    def loss(attend, q, k, v):
        out = attend(q, k, v, causal=causal, bias=None, mask=None, scale=None, segment_ids=ids)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    def reference(q, k, v, *, causal, bias, mask, scale, segment_ids):
        mask = None if segment_ids is None else with_segments(None, segment_ids, segment_ids)
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, mask=mask)

    want = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    with jax.set_mesh(_mesh(devices)):
        step = jax.value_and_grad(functools.partial(loss, attend), argnums=(0, 1, 2))
        got = jax.jit(step)(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)


@pytest.mark.parametrize(
    ("causal", "length", "heads", "kv_heads", "packed"),
    [(True, 32, 8, 2, False), (False, 30, 8, 2, True), (True, 30, 4, 4, True),
     (True, 31, 8, 1, False)],
)  # fmt: skip
def test_all_to_all_attention_is_xlas(causal, length, heads, kv_heads, packed):
    """4 devices: grouped-query heads (key/value heads repeated to divide them), a length they
    do not divide, packed documents: the output and all three gradients."""
    _against_xla(ulysses_attention("context"), causal, length, heads, kv_heads, packed, 4,
                 atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("causal", "length", "heads", "kv_heads", "packed", "devices", "balance"),
    [(True, 32, 2, 1, False, 4, True), (False, 30, 6, 2, True, 4, True),
     (True, 31, 4, 1, True, 8, True), (True, 32, 6, 3, True, 8, False),
     (True, 24, 4, 2, True, 8, True)],
)  # fmt: skip
def test_the_hybrids_groups_and_ring_are_xlas_attention(causal, length, heads, kv_heads, packed,
                                                        devices, balance):  # fmt: skip
    """Heads that do not divide the devices: all-to-alls within groups of 2 (or 4), the ring
    (zig-zag or not) across them; grouped heads, padding, packed documents, all gradients."""
    hybrid = ulysses_attention("context", hybrid=True, balance=balance)
    _against_xla(hybrid, causal, length, heads, kv_heads, packed, devices, atol=1e-4)


@pytest.mark.parametrize(("causal", "length", "packed"), [(True, 31, True), (False, 30, False)])
def test_the_hybrids_ring_meets_in_a_gpus_fused_kernel_as_xlas(monkeypatch, causal, length,
                                                              packed):  # fmt: skip
    """The hybrid's ring with each block pair in the fused kernel a GPU takes (Pallas'
    interpreter here): the same output and gradients."""
    import shardplug.strategies.cp.ulysses as ulysses

    monkeypatch.setattr(ulysses, "fused_blocks", lambda *a, **k: True)
    hybrid = ulysses_attention("context", hybrid=True)
    _against_xla(hybrid, causal, length, 4, 1, packed, 8, atol=1e-4)


def test_the_hybrids_group_is_the_most_devices_the_heads_divide():
    assert [group_size(h, kv, 8) for h, kv in ((4, 4), (6, 3), (6, 6), (5, 5), (32, 8))] == [
        4, 2, 2, 1, 8]  # fmt: skip


def test_key_value_heads_are_repeated_the_fewest_times_that_divide():
    assert [kv_repeats(8, kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_repeats(32, 8, 16) == 2
    with pytest.raises(ConfigError, match="cannot be repeated to divide 8 devices"):
        kv_repeats(12, 3, 8)


@pytest.mark.parametrize(
    ("name", "mesh", "adapter", "scheme"),
    [("fsdp+cp", "fsdp=2,context=4", "nnx", "ulysses"),
     ("fsdp+cp+tp", "fsdp=2,context=2,model=2", "linen", "ulysses"),
     ("dp+cp", "data=2,context=4", "equinox", "ulysses"),
     ("pp+cp", "stage=2,context=4", "nnx", "ulysses"),
     ("cp+tp", "context=4,model=2", "nnx", "hybrid"),
     ("cp+ep", "context=4,expert=2", "nnx", "ulysses")],
)  # fmt: skip
def test_compositions_with_all_to_all_cp_train_like_one_device(name, mesh, adapter, scheme):
    """Under tp each device's own heads are split over context (the hybrid: its 2 heads in
    groups of 2, a ring of 2); under ep, the transformer with 4 experts."""
    options = {"cp.scheme": scheme}
    if "fsdp" in name or "tp" in name:
        options["min_size"] = 0
    model = {"experts": 4} if "ep" in name else {}
    losses = _losses(name, options, adapter, "transformer", STEPS, 0, 8, mesh, model)
    want = one_device_losses(adapter, "transformer", STEPS, 0, tuple(model.items()))
    np.testing.assert_allclose(losses, want, rtol=1e-4)


@pytest.mark.parametrize("adapter", ["linen"])
def test_the_hybrid_trains_like_one_device_where_heads_do_not_divide_the_axis(adapter):
    """The reference transformer's 4 heads on context=8: all-to-alls in groups of 4, a ring
    of 2 across them."""
    options = {"cp.scheme": "hybrid"}
    losses = _losses("cp", options, adapter, "transformer", STEPS, 0, 8, "context=8", {})
    want = one_device_losses(adapter, "transformer", STEPS, 0, ())
    np.testing.assert_allclose(losses, want, rtol=1e-4)


def test_explain_counts_the_hybrids_all_to_alls_and_its_ring():
    """context=8, 4 heads: each block's 3/4 sent within its group of 4, and a ring of 2."""
    model = shardplug.get_model("transformer")
    strategy = shardplug.get_strategy("cp", scheme="hybrid")
    run = model.task("nnx").trainer(strategy=strategy, mesh="context=8", allocate=False)
    report = explain(run, next(model.batches(model.batch_size, 0))).to_dict()
    found = report["parallelisms"]["sequence"]
    block = 32 * 4 * 4 * 16 * 4  # 32 rows x 32/8 positions x 4 heads x 16 x f32
    assert found["all_to_all_textbook_per_layer"] == 2 * 4 * block * 3 // 4
    assert found["all_to_all_bytes"] == 2 * found["all_to_all_textbook_per_layer"]
    assert found["ring_permutes"] > 0 and found["ring_bytes"] > 0


def test_explain_counts_the_all_to_alls_against_the_textbook():
    """dp+cp (data=2, context=4), 2 layers: each layer's query, key, value and output blocks,
    3/4 of each sent, forward and backward: 16 all-to-alls of the textbook's bytes."""
    model = shardplug.get_model("transformer")
    strategy = shardplug.get_strategy("dp+cp", **{"cp.scheme": "ulysses"})
    run = model.task("nnx").trainer(strategy=strategy, mesh="data=2,context=4", allocate=False)
    report = explain(run, next(model.batches(model.batch_size, 0))).to_dict()
    found = report["parallelisms"]["sequence"]
    block = 16 * 8 * 4 * 16 * 4  # one device's 32/2 rows x 32/4 positions x 4 heads x 16 x f32
    assert found["all_to_all_textbook_per_layer"] == 2 * 4 * block * 3 // 4
    assert found["all_to_all_bytes"] == 2 * found["all_to_all_textbook_per_layer"]  # 2 layers
    assert found["all_to_alls"] == 2 * 2 * 4


def test_under_tp_each_devices_own_heads_go_through_the_all_to_alls():
    """fsdp+cp+tp (fsdp=2, context=2, model=2): the all-to-alls carry each tp device's 2 of
    the 4 heads, not all 4 gathered over model first."""
    model = shardplug.get_model("transformer")
    strategy = shardplug.get_strategy("fsdp+cp+tp", min_size=0, **{"cp.scheme": "ulysses"})
    run = model.task("nnx").trainer(strategy=strategy, mesh="fsdp=2,context=2,model=2",
                                    allocate=False)  # fmt: skip
    report = explain(run, next(model.batches(model.batch_size, 0))).to_dict()
    found = report["parallelisms"]["sequence"]
    block = 16 * 16 * 2 * 16 * 4  # 32/2 rows x 32/2 positions x 4/2 heads x 16 x f32
    assert found["all_to_all_textbook_per_layer"] == 2 * 4 * block // 2
    assert found["all_to_all_bytes"] == 2 * found["all_to_all_textbook_per_layer"]


def test_under_tp_heads_that_split_too_finely_are_gathered_and_said(monkeypatch):
    """cp+tp (context=4, model=2): 2 heads a tp device do not divide 4 context devices; the
    4 heads do: gathered whole over model, as before, and said once."""
    model = shardplug.get_model("transformer")
    strategy = shardplug.get_strategy("cp+tp", min_size=0, **{"cp.scheme": "ulysses"})
    run = model.task("nnx").trainer(strategy=strategy, mesh="context=4,model=2", allocate=False)
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    with pytest.warns(shardplug.errors.ShardplugWarning, match="-o cp.scheme=hybrid keeps"):
        explain(run, next(model.batches(model.batch_size, 0)))


def test_heads_that_do_not_divide_the_axis_are_refused_in_one_line():
    q = jnp.ones((1, 8, 6, 4))
    said = r"cp scheme ulysses splits the heads over 'context': 6 query heads do not divide "
    with jax.set_mesh(_mesh(4)), pytest.raises(ConfigError, match=said + "its 4 devices"):
        ulysses_attention("context")(
            q, q, q, causal=True, bias=None, mask=None, scale=None)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh", "name", "want"),
    [("data=2,context=4", "dp+cp", "ulysses"), ("context=8", "cp", "hybrid")],
)
def test_recommend_chooses_among_cps_schemes_and_says_why(mesh, name, want):
    """Of the schemes that fit, the fewest bytes: the all-to-all where the 4 heads divide the
    context axis (the hybrid, the same program, ties: the first named); where they do not (8
    devices), it is said why not, and the hybrid (groups of 4, a ring of 2) sends least."""
    from shardplug.planning.recommend import recommend

    model = shardplug.get_model("transformer")
    batch = next(model.batches(model.batch_size, 0))

    def compiled(strategy, options=None):
        strategy = shardplug.get_strategy(strategy, **(options or {}))
        return model.task("nnx").trainer(strategy=strategy, mesh=mesh, allocate=False), batch

    result = recommend(compiled, 2**34, strategies=[name])
    assert (result["recommended"], result["options"]) == (name, {"cp.scheme": want})
    tried = result["strategies"][0]["scheme"]["tried"]
    assert set(tried) == {"ring", "gather", "ulysses", "hybrid"}
    sent = {k: r["sent_bytes"] for k, r in tried.items() if r["fits"]}
    assert min(sent, key=sent.get) == want
    assert f"-o cp.scheme={want}: of cp's schemes that fit, it " in result["reason"]
    assert "(ring sends " in result["reason"]
    if want == "hybrid":
        assert "ulysses cannot run here (cp scheme ulysses splits the heads" in result["reason"]


@pytest.mark.parametrize(("hybrid", "heads", "kv_heads", "length"),
                         [(False, 8, 2, 13), (True, 4, 2, 16)])  # fmt: skip
def test_on_explicit_axes_tps_heads_go_through_the_all_to_alls(hybrid, heads, kv_heads, length):
    """context=2, model=2, explicit axes, the heads split over model by the run's rules:
    grouped key/value heads repeated on each device, a padded length cut back."""
    from shardplug.core.context import activation_rules

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("context", "model"), explicit, devices=jax.devices()[:4])
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, length, heads, 8))
    k, v = (jax.random.normal(key, (2, length, kv_heads, 8)) for key in keys[1:])

    def loss(attend, q, k, v):
        out = attend(q, k, v, causal=True, bias=None, mask=None, scale=None)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    def reference(q, k, v, **_):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    want = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    attend = ulysses_attention("context", hybrid=hybrid)
    with jax.set_mesh(mesh), activation_rules({"heads": "model"}):
        split = jax.sharding.NamedSharding(mesh, P(None, None, "model"))
        q, k, v = (jax.device_put(x, split) for x in (q, k, v))
        got = jax.jit(jax.value_and_grad(functools.partial(loss, attend), argnums=(0, 1, 2)))(
            q, k, v)  # fmt: skip
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
