"""Models from published libraries, built and called with their authors' code unchanged,
trained under shardplug's strategies and equal to the plain one-device loop their users write.

- ``esm2quinox``: ESM2, the protein language model, in Equinox: its own alphabet and
  tokeniser, a masked-LM head whose output projection is the input embedding, its layers
  stacked by ``eqx.filter_vmap`` and run by ``lax.scan``, rotary attention;
- ``recurrentgemma``: Griffin (RecurrentGemma) in Flax Linen: RG-LRU recurrent blocks between
  local-attention blocks, each block under ``nn.remat``, the logits decoded by the embedding.

Neither was written for shardplug: they carry no sharding annotations, so fsdp and tp split
their parameters by size. Both losses are weighted by tokens (masked positions, padding):
declared as ``shardplug.Mean``, they are the whole batch's wherever the step cuts it;
undeclared, grad_accum trains the mean of its microbatches' means, and says so once.

Each runs as its authors run it: Griffin broadcasts its block-diagonal gates' bias
(heads, width) against (batch, time, heads, width) by rank promotion, which conftest.py
forbids, so its runs allow it. Each test runs the model's own loop before shardplug's:
Equinox's rotary embedding caches its cos/sin table process-wide the first time it is
traced, and a table first made inside a step traced under ``jax.set_mesh`` belongs to that
mesh, so a later run on a mesh of another size could not trace (made outside any mesh
first, every mesh reads it).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardplug

esm2quinox = pytest.importorskip("esm2quinox")
recurrentgemma = pytest.importorskip("recurrentgemma.jax")

STRATEGIES = ["dp", "fsdp", "tp", "fsdp+tp", "dp+fsdp"]
STEPS, ROWS, LENGTH, DEVICES = 3, 16, 16, 8
TOL = 1e-5
OPTIMIZER = optax.adam(3e-3)


# -- ESM2 (Equinox): a masked language model over proteins --------------------------------


def esm2(embed_size: int = 32) -> "esm2quinox.ESM2":
    return esm2quinox.ESM2(
        num_layers=2, embed_size=embed_size, num_heads=4, token_dropout=True, key=jax.random.key(0)
    )


@functools.cache
def proteins() -> tuple[dict[str, np.ndarray], ...]:
    """Random proteins of 4 to 14 residues, tokenised by esm2quinox (start, stop, padding);
    15% of the residues masked, which the loss scores (a row may have none)."""
    rng = np.random.default_rng(0)
    residues = np.array(list("LAGVSERTIDPKQNFYMHWC"))
    mask = esm2quinox.tokenise(["#"])[0, 1]
    out = []
    for _ in range(STEPS):
        strings = ["".join(rng.choice(residues, rng.integers(4, LENGTH - 1))) for _ in range(ROWS)]
        targets = esm2quinox.tokenise(strings, length=LENGTH).astype(np.int32)
        is_residue = np.zeros_like(targets, bool)
        for row, s in enumerate(strings):
            is_residue[row, 1 : len(s) + 1] = True
        scored = is_residue & (rng.random(targets.shape) < 0.15)
        tokens = np.where(scored, mask, targets).astype(np.int32)
        out.append({"tokens": tokens, "targets": targets, "scored": scored.astype(np.float32)})
    return tuple(out)


def esm2_ce(model, batch):
    logits = jax.vmap(model)(batch["tokens"]).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce, batch["scored"]


def esm2_loss(model, batch):
    """The masked-LM loss, declared: the scored positions' sum and their count."""
    ce, w = esm2_ce(model, batch)
    return shardplug.Mean(jnp.sum(ce * w), jnp.sum(w))


def esm2_undeclared(model, batch):
    """The same loss as ESM2's users write it: a mean over the scored positions."""
    ce, w = esm2_ce(model, batch)
    return jnp.sum(ce * w) / jnp.sum(w)


@functools.cache
def esm2_own_loop() -> tuple[float, ...]:
    """Equinox's loop: ``eqx.filter_value_and_grad`` of the mean, ``eqx.filter_jit``."""
    model = esm2()
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(esm2_undeclared)(model, batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    with jax.default_device(jax.devices()[0]):
        for batch in proteins():
            model, opt_state, loss = step(model, opt_state, batch)
            losses.append(float(loss))
    return tuple(losses)


# -- Griffin (Flax Linen): a causal language model over padded rows -------------------------

RECURRENT, ATTENTION = (
    recurrentgemma.TemporalBlockType.RECURRENT,
    recurrentgemma.TemporalBlockType.ATTENTION,
)
GRIFFIN = recurrentgemma.GriffinConfig(
    vocab_size=64,
    width=32,
    mlp_expanded_width=96,
    num_heads=4,
    lru_width=32,
    block_types=(RECURRENT, ATTENTION),
    embeddings_scale_by_sqrt_dim=True,
    attention_window_size=8,
    logits_soft_cap=30.0,
    scan_type=recurrentgemma.ScanType.LINEAR_NATIVE,
)
#: Griffin adds its gates' bias by rank promotion, which conftest.py forbids
GRIFFIN_RANK_PROMOTION = "allow"


@functools.cache
def texts() -> tuple[dict[str, np.ndarray], ...]:
    """Rows of random tokens, each of a random length and padded after it; the positions
    Griffin takes with them (``segment_pos``)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(2, LENGTH + 1, ROWS)
        real = np.arange(LENGTH)[None, :] < lengths[:, None]
        tokens = np.where(real, rng.integers(1, GRIFFIN.vocab_size, (ROWS, LENGTH)), 0)
        out.append({
            "tokens": tokens.astype(np.int32),
            "positions": np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)),
            "real": real.astype(np.float32),
        })  # fmt: skip
    return tuple(out)


def griffin_ce(logits, batch):
    """Next-token cross-entropy and the positions it scores (the real tokens after the
    first)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return ce, batch["real"][:, 1:]


def griffin_forward(model, batch):
    logits, _ = model(batch["tokens"][:, :-1], batch["positions"][:, :-1], return_cache=False)
    return logits


def griffin_loss(model, batch):
    """The padded causal-LM loss, declared (``model`` is the Linen module, bound)."""
    ce, w = griffin_ce(griffin_forward(model, batch), batch)
    return shardplug.Mean(jnp.sum(ce * w), jnp.sum(w))


@functools.cache
def griffin_variables():
    batch = {k: jnp.asarray(v[:, :-1]) for k, v in texts()[0].items()}  # typeguard: jax arrays
    with jax.numpy_rank_promotion(GRIFFIN_RANK_PROMOTION):
        init = jax.jit(recurrentgemma.Griffin(GRIFFIN).init)
        return init(jax.random.key(0), batch["tokens"], batch["positions"])


@functools.cache
def griffin_own_loop() -> tuple[float, ...]:
    """Linen's loop: ``model.apply`` inside ``jax.value_and_grad``, ``jax.jit``."""
    model = recurrentgemma.Griffin(GRIFFIN)
    params = griffin_variables()["params"]
    opt_state = OPTIMIZER.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_of(params):
            logits, _ = model.apply(
                {"params": params},
                batch["tokens"][:, :-1],
                batch["positions"][:, :-1],
                return_cache=False,
            )
            ce, w = griffin_ce(logits, batch)
            return jnp.sum(ce * w) / jnp.sum(w)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    with jax.default_device(jax.devices()[0]), jax.numpy_rank_promotion(GRIFFIN_RANK_PROMOTION):
        for batch in texts():
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
    return tuple(losses)


# -- the two, under shardplug ----------------------------------------------------------------


class Library(NamedTuple):
    adapter: Callable[[], shardplug.Adapter]
    loss_fn: Callable
    data: Callable[[], tuple]
    own_loop: Callable[[], tuple[float, ...]]
    rank_promotion: str = "raise"


MODELS = {
    "esm2": Library(lambda: shardplug.from_equinox(esm2()), esm2_loss, proteins, esm2_own_loop),
    "griffin": Library(
        lambda: shardplug.from_linen(recurrentgemma.Griffin(GRIFFIN),
                                     variables=griffin_variables()),
        griffin_loss, texts, griffin_own_loop, GRIFFIN_RANK_PROMOTION,
    ),
}  # fmt: skip


def trained(name, strategy, devices=DEVICES, loss_fn=None, **options):
    """The trainer of a model and its losses under shardplug; its own loop has run first."""
    library = MODELS[name]
    library.own_loop()  # first, outside any mesh: see test_esm2_on_8_devices_then_on_4
    trainer = shardplug.Trainer(
        library.adapter(), loss_fn=loss_fn or library.loss_fn, optimizer=OPTIMIZER,
        strategy=strategy, devices=devices, precision="float32", **options,
    )  # fmt: skip
    with jax.numpy_rank_promotion(library.rank_promotion):
        losses = [r["loss"] for r in trainer.fit(list(library.data()), steps=STEPS)]
    return trainer, losses


@functools.cache
def under(name, strategy):
    """A model's losses under a strategy on 8 devices, and whether it split any parameter."""
    trainer, losses = trained(name, strategy)
    specs = jax.tree.leaves(trainer.param_shardings, is_leaf=lambda s: hasattr(s, "spec"))
    return tuple(losses), any(s.spec != P() for s in specs)


def assert_like(got, want):
    np.testing.assert_allclose(got, want, rtol=TOL)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_library_model_trains_like_its_own_loop(name, strategy):
    """8 devices; fsdp and tp split the parameters they hold 1024 elements or more of."""
    losses, split = under(name, strategy)
    assert_like(losses, MODELS[name].own_loop())
    assert split == (strategy != "dp")


@pytest.mark.parametrize(
    ("strategy", "options"), [("dp", {"grad_accum": 4}), ("pmap", {})], ids=["grad-accum", "pmap"]
)
def test_esm2s_masked_lm_loss_is_the_whole_batchs_wherever_the_batch_is_cut(strategy, options):
    """4 devices: 4 microbatches of a row each per device, or 4 per-device programs, each
    with its own count of masked positions."""
    _, losses = trained("esm2", strategy, devices=4, **options)
    assert_like(losses, esm2_own_loop())


def test_esm2s_loss_undeclared_is_averaged_over_microbatches_and_said_once(monkeypatch):
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    with pytest.warns(shardplug.ShardplugWarning, match="own losses") as said:
        _, losses = trained("esm2", "dp", devices=4, loss_fn=esm2_undeclared, grad_accum=4)
    assert len([w for w in said if "own losses" in str(w.message)]) == 1
    # the objective it trains is the microbatches' mean of means: not one device's
    assert abs(losses[0] - esm2_own_loop()[0]) > 1e-3


def test_griffins_padded_causal_lm_loss_is_the_whole_batchs_under_grad_accum():
    _, losses = trained("griffin", "dp", devices=4, grad_accum=2)
    assert_like(losses, griffin_own_loop())


def test_tied_embeddings_train_like_their_own_loop():
    """Both decode the logits with their input embedding: ESM2 embeds by its output
    projection's weight, Griffin's embedder decodes by its table. One array, two uses, its
    gradient the sum of both: nothing to say to shardplug, and dp trains them as their loops."""
    model = esm2()
    assert model.embedding.weight is model.logit_head.linear2.weight
    params = griffin_variables()["params"]
    assert list(params["embedder"]) == ["input_embedding"]
    assert not [k for k in params if k not in ("embedder", "final_norm")
                and not k.startswith("blocks.")]  # fmt: skip
    for name in MODELS:
        assert_like(under(name, "dp")[0], MODELS[name].own_loop())


def test_pp_says_what_each_librarys_blocks_are_and_what_would_run_them():
    """ESM2 stacks its layers and scans them itself; Griffin's blocks are a list of two
    kinds: pp names each form in one line, with the change that runs it (or why none does)."""
    said = {
        "esm2": r"this model names none: it stores 2 layers stacked under layers/ \(each "
        r"leaf's first dimension 2\): name that dimension in the adapter's rules",
        "griffin": r"its blocks are a Python list of 2 \(blocks\.0 \.\.\. blocks\.1\) of 2 "
        r"kinds: recurrent_block \(0\) and attention_block \(1\), which do not repeat",
    }
    for name, message in said.items():
        with pytest.raises(shardplug.ConfigError, match=message):
            trained(name, "pp", devices=4)
