"""precision="bf16" is a promise about the lowered step: its matrix products run in bfloat16.

Counted in the lowered program's text (``stablehlo.dot_general`` and ``convolution``
operand types), for models written with each framework's stock layers and no dtype, the
reference models and the outside models the suite trains; the few products left are JAX's
attention keeping the softmax's probabilities float32 in the backward pass.
"""

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_outside_models import LinenCNN, NnxCNN, images, vectors

import shardplug
from shardplug.core.flops import product_dtypes

VOCAB, WIDTH, SEQ, ROWS = 64, 32, 16, 8
PRODUCT = re.compile(
    r"stablehlo\.(?:dot_general|convolution).*?: \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)"
)


def bf16_share(trainer, batch):
    """The share of the lowered step's matrix products whose operands are both bfloat16."""
    found = PRODUCT.findall(trainer.lower(batch).as_text())
    assert found, "no matrix product in the lowered step"
    return sum(a == b == "bf16" for a, b in found) / len(found)


class NnxLM(nnx.Module):
    """Flax NNX's stock layers, no dtype anywhere."""

    def __init__(self, rngs, head_dtype=None):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, WIDTH, decode=False, rngs=rngs)
        self.mix = nnx.LinearGeneral(WIDTH, (2, WIDTH // 2), rngs=rngs)
        self.conv = nnx.Conv(WIDTH, WIDTH, kernel_size=(3,), rngs=rngs)
        self.rms = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, dtype=head_dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm(x))
        x = x + self.mix(x).reshape(x.shape)
        x = x + self.conv(self.rms(x))
        return self.head(x)


class LinenLM(nn.Module):
    """Flax Linen's stock layers, no dtype anywhere."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(x))
        x = x + nn.DenseGeneral((2, WIDTH // 2))(x).reshape(x.shape)
        x = x + nn.Conv(WIDTH, (3,))(nn.RMSNorm()(x))
        return nn.Dense(VOCAB)(x)


class EqxLM(eqx.Module):
    """Equinox's stock layers, one sequence at a time."""

    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    conv: eqx.nn.Conv1d
    rms: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k[0])
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(4, WIDTH, key=k[1])
        self.conv = eqx.nn.Conv1d(WIDTH, WIDTH, 3, padding=1, key=k[2])
        self.rms = eqx.nn.RMSNorm(WIDTH)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=k[3])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        x = x + self.conv(jax.vmap(self.rms)(x).T).T
        return jax.vmap(self.head)(x)


def lm_loss(logits, batch):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"][:, 1:]).mean()


TOKENS = {"t": np.random.default_rng(0).integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)}
STOCK = {
    "nnx": (lambda: shardplug.from_nnx(NnxLM), lambda m, b: lm_loss(m(b["t"][:, :-1]), b)),
    "linen": (lambda: shardplug.from_linen(LinenLM(), TOKENS["t"][:, :-1]),
              lambda m, b: lm_loss(m(b["t"][:, :-1]), b)),
    "equinox": (lambda: shardplug.from_equinox(EqxLM(jax.random.key(0))),
                lambda m, b: lm_loss(jax.vmap(m)(b["t"][:, :-1]), b)),
}  # fmt: skip


def planned(adapter, loss_fn, precision="bf16", strategy="dp"):
    return shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optax.adam(1e-3), strategy=strategy,
        precision=precision, allocate=False,
    )  # fmt: skip


@pytest.mark.parametrize("framework", list(STOCK))
def test_stock_layers_compute_in_bfloat16(framework):
    adapter, loss_fn = STOCK[framework]
    assert bf16_share(planned(adapter(), loss_fn, "float32"), TOKENS) == 0.0
    assert bf16_share(planned(adapter(), loss_fn), TOKENS) >= 0.9


@pytest.mark.parametrize("model", ["mlp", "classifier", "transformer", "cnn"])
def test_reference_models_compute_in_bfloat16(model, make_trainer):
    reference = shardplug.get_model(model)
    batch = next(iter(reference.batches(batch_size=8, seed=0)))
    for adapter in ("nnx", "linen", "equinox"):
        _, trainer = make_trainer(model, adapter=adapter, precision="bf16", allocate=False)
        assert bf16_share(trainer, batch) >= 0.9, adapter


OUTSIDE = {
    "nnx": (lambda: shardplug.from_nnx(lambda rngs: NnxCNN(rngs=rngs)), images),
    "linen": (lambda: shardplug.from_linen(LinenCNN(), images()[0]["image"]), images),
    "equinox": (lambda: shardplug.from_equinox(eqx.nn.MLP(12, 3, 64, 2, key=jax.random.key(0))),
                vectors),
}  # fmt: skip


@pytest.mark.parametrize("framework", list(OUTSIDE))
def test_outside_models_compute_in_bfloat16(framework):
    from test_outside_models import cross_entropy, eqx_mse

    adapter, data = OUTSIDE[framework]
    loss_fn = eqx_mse if framework == "equinox" else cross_entropy
    assert bf16_share(planned(adapter(), loss_fn), data()[0]) >= 0.9


def test_a_layer_built_in_float32_stays_float32_and_is_named():
    """A layer with an explicit float32 dtype keeps it; compiling says where, explain too."""
    adapter = shardplug.from_nnx(lambda rngs: NnxLM(rngs, head_dtype=jnp.float32))
    trainer = planned(adapter, STOCK["nnx"][1])
    with pytest.warns(shardplug.ShardplugWarning, match=r"compute in float32, at test_precisio"):
        trainer.compile(TOKENS)
    dtypes = product_dtypes(trainer.jaxpr)
    assert 0.0 < dtypes.share("float32") < 0.5
    assert dtypes.float32_sites[0][0].startswith("test_precision.py:")  # the model's own line

    from shardplug.planning.explain import explain

    report = explain(trainer, TOKENS)
    assert report.precision["compute"] == "bfloat16"
    assert report.precision["float32_sites"][0]["where"].startswith("test_precision.py:")
    assert any("compute in float32" in note for note in report.notes)


def test_embeddings_follow_their_parameters_into_bfloat16():
    """nnx.Embed fixed its dtype to float32 when built; under bf16 it returns bfloat16."""
    from shardplug.core.context import computing_in

    adapter = shardplug.from_nnx(NnxLM)
    params, state = adapter.init(jax.random.key(0))
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with computing_in(jnp.bfloat16):
        model = adapter.bind(cast, state, rng=jax.random.key(0), train=True)
        assert shardplug.compute_dtype() == jnp.bfloat16
    assert model.embed(TOKENS["t"]).dtype == jnp.bfloat16
    assert shardplug.compute_dtype() is None  # outside a step
    plain = adapter.bind(params, state, rng=jax.random.key(0), train=True)
    assert plain.embed.dtype == jnp.float32  # binding outside a bf16 step changes nothing


def test_precision_defaults_to_bfloat16_where_the_devices_have_the_units_for_it(capsys):
    from types import SimpleNamespace

    from shardplug.core.precision import auto_precision

    def device(platform, capability=None, kind="NVIDIA H100 80GB HBM3"):
        return SimpleNamespace(platform=platform, compute_capability=capability, device_kind=kind)

    assert auto_precision(device("gpu", "9.0")) == ("bf16", "the NVIDIA H100 80GB HBM3's "
                                                    "bfloat16 tensor cores")  # fmt: skip
    assert auto_precision(device("gpu", "8.0", "A100"))[0] == "bf16"
    assert auto_precision(device("gpu", "7.0", "Tesla V100")) == (
        "float32",
        "the Tesla V100 has no bfloat16 tensor cores",
    )
    assert auto_precision(device("tpu"))[0] == "bf16"
    assert auto_precision(device("cpu")) == ("float32", "a CPU has no bfloat16 matrix units")
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.1), devices=2)  # fmt: skip
    assert trainer.precision == "float32"
    trainer.fit(model.batches(8, 0), steps=1)
    assert (
        capsys.readouterr().err.strip().endswith("; float32 (a CPU has no bfloat16 matrix units)")
    )
    picked = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                               optimizer=optax.sgd(0.1), devices=2, precision="bf16")  # fmt: skip
    assert picked.precision == "bf16" and picked.precision_reason == "as asked"
