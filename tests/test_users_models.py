"""Models written elsewhere, the ordinary way, under the parallelisms that split what they hold,
each trained against its framework's plain loop: grouped-query attention and next-token
slicing under cp (tests/llama_models.py), Flax's Gemma in explicit mode with its own mesh
annotations (tests/gemma_model.py), experts written by hand (tests/switch_moe.py)."""

import contextlib
import functools

import gemma_model as gemma
import jax
import jax.numpy as jnp
import llama_models as llama
import numpy as np
import optax
import pytest
import switch_moe as switch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.compiled.hlo import collectives
from shardplug.strategies.cp.ring import ring_attention

STEPS = 2


@functools.cache
def _one_device(framework: str) -> tuple[float, ...]:
    return tuple(llama.one_device_losses(framework, STEPS))


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
@pytest.mark.parametrize(
    ("name", "mesh"),
    [
        ("fsdp+cp", "fsdp=2,context=4"),
        ("cp+tp", "context=4,model=2"),
        ("pp+cp", "stage=2,context=4"),
    ],
)
def test_a_gqa_llama_fed_tokens_minus_one_trains_like_one_device(
    framework, name, mesh, monkeypatch
):
    """4 query heads over 2 key/value heads, a sequence of 31 (tokens[:, :-1] of 32) that the
    ring pads to whole blocks: the losses of the framework's own one-device loop (it crashed
    in the ring's einsum, then in the shard_map of a sequence 4 devices do not divide).

    Under pp+cp the padded sequence is laid out one way in a stage's pass and another in the
    buffers pp's written-in schedules keep it in: the compiler moves it between them with
    all-gathers that nothing orders against pp's sends, and XLA:CPU runs them in each device's
    own order (150 steps, three runs at once: all three waited forever). pp's default runs
    GPipe instead, and says so."""
    adapter, loss_fn = llama.adapter(framework)
    options = {"min_size": 0} if "fsdp" in name or "tp" in name else {}
    trainer = shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optax.adam(llama.LR),
        strategy=shardplug.get_strategy(name, **options), mesh=mesh,
    )  # fmt: skip
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    falls_back = name.startswith("pp")
    said = pytest.warns(shardplug.ShardplugWarning, match="pp runs gpipe.*all-gathers between")
    with said if falls_back else contextlib.nullcontext():
        losses = [r["loss"] for r in trainer.fit(llama.batches(0), steps=STEPS)]
    np.testing.assert_allclose(losses, _one_device(framework), rtol=1e-4)


def test_a_written_in_schedule_that_could_wait_forever_on_cpu_is_one_line():
    """Asked for by name, the schedule the default avoids is refused before it runs."""
    adapter, loss_fn = llama.adapter("nnx")
    trainer = shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optax.adam(llama.LR),
        strategy=shardplug.get_strategy("pp+cp", schedule="1f1b"), mesh="stage=2,context=4",
    )  # fmt: skip
    with pytest.raises(
        shardplug.ConfigError,
        match=r"^pp's 1f1b schedule on CPU devices: the "
        r"compiler put \d+ all-gathers between the passes.*pp.schedule=gpipe$",
    ):
        trainer.fit(llama.batches(0), steps=1)


def _attention_loss(attend, causal, q, k, v):
    out = attend(q, k, v, causal=causal, bias=None, mask=None, scale=None)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))


def _xla(q, k, v, causal, bias, mask, scale):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize(
    ("kv_heads", "length", "causal", "balance"),
    [(2, 64, True, True), (1, 64, True, False), (2, 61, True, True), (1, 59, False, True)],
)
def test_the_ring_takes_grouped_and_multi_query_heads_and_any_length(
    kv_heads, length, causal, balance
):
    """On 8 context devices, 4 query heads over 2 (grouped-query) or 1 (multi-query)
    key/value heads, sequences that 8 (or 16, zig-zag) devices do not divide: the output and
    the gradients of q, k and v are jax.nn.dot_product_attention's on one device."""
    mesh = jax.make_mesh((8,), ("context",), (AxisType.Auto,), devices=jax.devices()[:8])
    q = jax.random.normal(jax.random.key(0), (2, length, 4, 8))
    k, v = jax.random.normal(jax.random.key(1), (2, 2, length, kv_heads, 8))
    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2))
    want = grad(functools.partial(_attention_loss, _xla, causal))(q, k, v)
    ring = ring_attention("context", balance=balance)
    with jax.set_mesh(mesh):
        got = jax.jit(grad(functools.partial(_attention_loss, ring, causal)))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_gqa_ring_sends_the_key_value_heads_only(kv_heads):
    """The compiled ring (8 devices, the plain ring: no deal) passes blocks of the key/value
    heads, not of the 4 query heads: k and v, 7 steps each, forward and backward (their
    gradients), each a device's rows x 64/8 positions x kv_heads x 8 x 4 B."""
    mesh = jax.make_mesh((8,), ("context",), (AxisType.Auto,), devices=jax.devices()[:8])
    q = jax.ShapeDtypeStruct((2, 64, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, kv_heads, 8), jnp.float32)
    loss = functools.partial(_attention_loss, ring_attention("context", balance=False), True)
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    (found,) = [c for c in collectives(text) if c.kind == "collective-permute"]
    assert found.count == 2 * 7 * 2
    assert found.bytes == 2 * 7 * 2 * (2 * 8 * kv_heads * 8 * 4)


def test_a_batch_the_context_devices_do_not_divide_is_read_whole():
    """A batch of 17 positions (tokens of L + 1, as a model fed tokens[:, :-1] reads them)
    does not split over 8 devices: the leaf is placed whole on each, attention pads and
    splits the activations, and the reference transformer trains like one device (it was
    refused)."""
    model = shardplug.get_model("transformer")

    def losses(strategy, devices):
        trainer = model.task("nnx").trainer(strategy=strategy, devices=devices)
        rows = ({k: v[:, :17] for k, v in b.items()} for b in model.batches(model.batch_size, 0))
        out = [r["loss"] for r in trainer.fit(rows, steps=STEPS)]
        return out, trainer.batch_shardings["tokens"].spec

    got, spec = losses("cp", 8)
    assert spec == P()
    np.testing.assert_allclose(got, losses("dp", 1)[0], rtol=1e-4)


# -- Flax's Gemma in explicit mode, its parameters where it puts them ------------------------


@pytest.fixture
def broadcasting():
    """Gemma's code broadcasts (8, 16, 64) by (64,), as NumPy does; the suite forbids it."""
    with jax.numpy_rank_promotion("allow"):
        yield


@functools.cache
def _gemma_plain() -> tuple[float, ...]:
    return tuple(gemma.plain_losses(STEPS))


def _gemma_trainer(strategy, mesh, fsdp="fsdp", **kwargs):
    config = gemma.ShardingConfig.fsdp_tp_sharding(fsdp=fsdp)
    adapter = shardplug.from_nnx(lambda rngs: gemma.Gemma(config, rngs=rngs))
    return shardplug.Trainer(
        adapter, loss_fn=gemma.loss_fn, optimizer=optax.adam(gemma.LR), strategy=strategy,
        mesh=mesh, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "mesh", "fsdp"),
    [
        ("fsdp+tp", "fsdp=4,tp=2", "fsdp"),
        # its rows over both batch axes: the example's ShardingConfig takes the axis name
        ("dp+fsdp+tp", "data=2,fsdp=2,tp=2", ("data", "fsdp")),
        ("fsdp", "fsdp=8,tp=1", "fsdp"),  # the model's 'tp' kept whole: an axis of size 1
    ],
)
def test_flax_gemma_on_explicit_axes_keeps_its_own_placement(strategy, mesh, fsdp, broadcasting):
    """Every parameter stored (and its optimizer state) exactly as the model annotates it,
    the losses of the example's own loop on a (fsdp=4, tp=2) explicit mesh (it was refused:
    fsdp would have gathered what the model uses split), and explain says "model"."""
    from shardplug.planning.explain import explain

    trainer = _gemma_trainer(strategy, mesh, fsdp, axis_names={"model": "tp"} if "tp" in
                             strategy else None)  # fmt: skip
    losses = [r["loss"] for r in trainer.fit(gemma.batches(0), steps=STEPS)]
    np.testing.assert_allclose(losses, _gemma_plain(), rtol=1e-4)
    shardings = trainer.param_shardings
    assert trainer.axis_types == "explicit"
    assert shardings["embedder"]["embedding"].spec == P("tp", fsdp)
    assert shardings["layers"][0]["attn"]["kv_einsum"]["kernel"].spec == P(None, "tp", fsdp)
    assert shardings["layers"][1]["mlp"]["down_proj"]["kernel"].spec == P("tp", fsdp)
    assert shardings["final_norm"]["scale"].spec == P("tp")
    report = explain(trainer, next(gemma.batches(0)))
    assert {p.placed_by for p in report.params} == {"model"}


def test_what_the_mesh_cannot_give_gemma_is_one_line(broadcasting):
    """An axis the model names and the mesh lacks; rows split over fewer axes than the
    batch's; a mesh axis that does not divide a dimension the model places on it."""
    with pytest.raises(shardplug.ConfigError) as info:
        _gemma_trainer("fsdp", None).fit(gemma.batches(0), steps=1)
    assert "names mesh axis 'tp'" in str(info.value) and "(--mesh fsdp=8,tp=1)" in str(info.value)
    with pytest.raises(shardplug.ConfigError) as info:
        _gemma_trainer("dp+fsdp+tp", "data=2,fsdp=2,tp=2", axis_names={"model": "tp"}).fit(
            gemma.batches(0), steps=1
        )
    assert "the batch's rows are split over ('data', 'fsdp')" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    with pytest.raises(shardplug.CompositionError, match=r"over \('tp',\) \(8 devices\), which "
                       r"does not divide its 4"):  # fmt: skip
        _gemma_trainer("fsdp+tp", "fsdp=1,tp=8", axis_names={"model": "tp"}).fit(
            gemma.batches(0), steps=1
        )


# -- experts written by hand ------------------------------------------------------------------


def test_hand_written_experts_under_ep_train_right_and_are_said(capsys):
    """GShard's dense dispatch and combine, experts annotated 'expert': dp+ep stores them a
    quarter per device and trains like one device, but the compiler gathers them whole and
    nothing moves by all-to-all: one warning says so, and explain shows it."""
    from shardplug.planning.explain import explain

    def trainer(strategy, devices, mesh=None, allocate=True):
        adapter = shardplug.from_nnx(lambda rngs: switch.SwitchLM(rngs))
        return shardplug.Trainer(
            adapter, loss_fn=switch.loss_fn, optimizer=optax.adam(1e-3), strategy=strategy,
            devices=devices, mesh=mesh, allocate=allocate,
        )  # fmt: skip

    split = trainer("dp+ep", 8, "data=2,expert=4")
    assert split.param_shardings["w_in"].spec == P("expert")
    with pytest.warns(shardplug.ShardplugWarning) as said:
        losses = [r["loss"] for r in split.fit(switch.batches(0), steps=STEPS)]
    (line,) = [str(w.message) for w in said if "routed_experts" in str(w.message)]
    assert "never called shardplug.moe.routed_experts, so no token moved" in line
    assert "16.0 kiB whole, stored 1/4 per device over 'expert'; w_in, w_out" in line
    found = {c.kind for c in collectives(split.compiled.as_text())}
    assert "all-gather" in found and "all-to-all" not in found
    alone = [r["loss"] for r in trainer("dp", 1).fit(switch.batches(0), steps=STEPS)]
    np.testing.assert_allclose(losses, alone, rtol=1e-5)
    report = explain(trainer("dp+ep", 8, "data=2,expert=4", False), next(switch.batches(0)))
    (note,) = [n for n in report.notes if "routed_experts" in n]
    assert note.endswith("(the compiled step all-gathers 16.0 kiB)")


def test_experts_named_otherwise_are_named_in_eps_refusal():
    adapter = shardplug.from_nnx(lambda rngs: switch.SwitchLM(rngs, expert_name="experts"))
    with pytest.raises(shardplug.ConfigError) as info:
        shardplug.Trainer(adapter, loss_fn=switch.loss_fn, optimizer=optax.adam(1e-3),
                          strategy="dp+ep", mesh="data=2,expert=4")  # fmt: skip
    message = str(info.value)
    assert "the dimension a model names 'expert', and this model has none" in message
    assert "it names 'experts' on w_in, a dimension ep does not take: name it 'expert'" in message
    assert len(message.splitlines()) == 1
