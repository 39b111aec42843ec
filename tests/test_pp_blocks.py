"""Models whose blocks are written as libraries write them, under pp: a Python list of blocks of
one structure (Gemma's ``layer_0`` ...), a list of blocks of several kinds (Griffin's recurrent
and attention blocks), and layers the model stacks and scans itself (ESM2's
``eqx.filter_vmap`` and ``lax.scan``): each refused in one line that says exactly which form
it is and the smallest change that runs it; the change made, it trains like one device."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplug
from shardplug.errors import ConfigError

WIDTH, ROWS = 8, 16


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(WIDTH)(x))


class Recurrent(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(WIDTH, name="recurrent_block")(x))


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(WIDTH, name="attention_block")(x))


class GemmaLike(nn.Module):
    """Blocks named layer_0 ... in a loop, as Gemma's Linen code names them."""

    layers: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        for i in range(self.layers):
            x = Dense(name=f"layer_{i}")(x)
        return nn.Dense(1, name="head")(x)


class GriffinLike(nn.Module):
    """Blocks of two kinds in one list, named blocks.0 ..., as Griffin's pattern makes them."""

    pattern: tuple[str, ...] = ("r", "r", "a") * 2 + ("r", "r")

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        for i, kind in enumerate(self.pattern):
            x = (Recurrent if kind == "r" else Attention)(name=f"blocks.{i}")(x)
        return nn.Dense(1, name="head")(x)


class EsmLike(eqx.Module):
    """Layers made by eqx.filter_vmap and applied by the model's own lax.scan (ESM2's form)."""

    embed: eqx.nn.Linear
    layers: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
        keys = jax.random.split(k2, 4)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(keys)
        self.head = eqx.nn.Linear(WIDTH, 1, key=k3)

    def __call__(self, x, key=None, inference=None):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer):
            return h + jnp.tanh(jax.vmap(eqx.combine(layer, static))(h)), None

        h, _ = jax.lax.scan(body, jax.vmap(self.embed)(x), dynamic)
        return jax.vmap(self.head)(h)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def adapter(model, **kwargs):
    if isinstance(model, nn.Module):
        return shardplug.from_linen(model, jnp.ones((1, WIDTH)), **kwargs)
    return shardplug.from_equinox(model, **kwargs)


def trainer(model, strategy="pp", devices=4, **kwargs):
    task = shardplug.Task(adapter(model, **kwargs), loss_fn, optax.sgd(0.1), data=())
    return task.trainer(strategy=strategy, devices=devices, precision="float32")


def batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(ROWS, 1)).astype(np.float32)}  # fmt: skip


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (GemmaLike(), {}, r"pp splits a layer stack over 'stage', and this model has none: its "
         r"blocks are a Python list of 8 of one structure \(layer_0 \.\.\. layer_7\), called one "
         r"by one: hold them as one stack and call it once in place of the loop \(shardplug\."
         r"stack: nnx_layers and apply in NNX, LinenLayers in Linen"),
        (GriffinLike(), {}, r"its blocks are a Python list of 8 \(blocks\.0 \.\.\. blocks\.7\) "
         r"of 2 kinds: recurrent_block \(0, 1, 3, 4, 6, 7\) and attention_block \(2, 5\), which "
         r"do not repeat in whole periods: .* leave pp out \(fsdp and tp split it as it is\)$"),
        (GriffinLike(pattern=("r", "r", "a") * 2), {}, r"of 2 kinds: recurrent_block \(0, 1, 3, "
         r"4\) and attention_block \(2, 5\); the kinds repeat every 3 blocks \(recurrent_block, "
         r"recurrent_block, attention_block\), so a stack of 2 blocks, each one period of 3, "
         r"runs under pp"),
        (EsmLike, {}, r"and this model names none: it stores 4 layers stacked under layers/ "
         r"\(each leaf's first dimension 4\): name that dimension in the adapter's rules, "
         r"rules=\{r'layers/\.\*': \('layers',\)\}, and apply them with shardplug\.stack "
         r"\(shardplug\.stack\.scan\(block, layers, x\) in place of a lax\.scan of the "
         r"model's own\)"),
        (GriffinLike(), {"rules": {r"blocks\..*": ("layers",)}}, r"^the rules name the first "
         r"dimension of each of blocks\.0 \.\.\. blocks\.7 'layers', but those are 8 separate "
         r"blocks of a list, not a layer stack: its blocks are a Python list of 8"),
    ],
)  # fmt: skip
def test_pp_says_which_form_the_blocks_take_and_what_runs_them(model, kwargs, message):
    with pytest.raises(ConfigError, match=message) as said:
        trainer(model, **kwargs).compile(batch())
    assert "\n" not in str(said.value)


def test_the_list_trains_under_every_other_strategy_as_written():
    got = [r["loss"] for r in trainer(GriffinLike(), "fsdp", 4).fit([batch()] * 2, steps=2)]
    want = [r["loss"] for r in trainer(GriffinLike(), "dp", 1).fit([batch()] * 2, steps=2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


class EsmScanned(EsmLike):
    """EsmLike with the change pp asks for: shardplug.stack.scan in place of its lax.scan."""

    def __call__(self, x, key=None, inference=None):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def block(layer, h):
            return h + jnp.tanh(jax.vmap(eqx.combine(layer, static))(h))

        h = shardplug.stack.scan(block, dynamic, jax.vmap(self.embed)(x))
        return jax.vmap(self.head)(h)


class GemmaStacked(nn.Module):
    """GemmaLike with the change pp asks for: its blocks one LinenLayers, called once."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        x = shardplug.stack.LinenLayers(Dense, 8, name="layers")(x)
        return nn.Dense(1, name="head")(x)


RULES = {"rules": {r"layers/.*": ("layers",)}}


@pytest.mark.parametrize("schedule", ["zb", "gpipe"])
def test_layers_named_but_run_by_the_models_own_scan_are_refused(schedule):
    """Named as a stack by the rules, ESM2's layers are still run by its own scan: the
    schedules cannot cut it, and GPipe would store them over the stages and run every layer
    on every device; both say so in one line."""
    pp = shardplug.get_strategy("pp", schedule=schedule)
    with pytest.raises(
        ConfigError,
        match=r"never called shardplug.stack: layers it applies "
        r"with its own loop .* call shardplug.stack.scan\(block, layers, x\)",
    ):
        trainer(EsmLike, pp, **RULES).compile(batch())


@pytest.mark.parametrize(("model", "kwargs"), [(GemmaStacked(), RULES), (EsmScanned, RULES)])
def test_the_change_pp_asks_for_trains_like_one_device(model, kwargs):
    data = [batch()] * 2
    got = [r["loss"] for r in trainer(model, "pp", 4, **kwargs).fit(data, steps=2)]
    want = [r["loss"] for r in trainer(model, "dp", 1, **kwargs).fit(data, steps=2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_stack_whose_block_has_numbered_children_is_a_stack():
    """The reference transformer's Linen block calls its LayerNorm twice (LayerNorm_0,
    LayerNorm_1 inside the stack): no list of blocks, and pp runs it."""
    model = shardplug.get_model("transformer")
    trainer = model.task("linen", layers=4).trainer(strategy="pp", devices=4)
    trainer.compile(next(model.batches(16, 0)))


def test_linen_layers_of_their_own_shapes_are_no_list_of_blocks():
    """Linen's Dense_0, Dense_1, Dense_2 of an MLP: layers, not blocks; pp says to build a
    stack, as for the same MLP in NNX."""
    model = shardplug.get_model("mlp")
    with pytest.raises(ConfigError, match=r"this model has none: build its blocks with "):
        model.task("linen").trainer(strategy="pp", devices=4).compile(next(model.batches(16, 0)))


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_a_stacks_block_of_auto_named_layers_is_a_stack(schedule):
    """A Linen block of Dense_0 ... Dense_3 of two widths, stacked: layers inside a block,
    not a list of blocks, whatever their shapes; it trains like one device under GPipe and
    zero-bubble (whose B and W once traced its pullback apart, B handing W 4 values of 5)."""

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (WIDTH, 2 * WIDTH, 2 * WIDTH, WIDTH):
                x = nn.Dense(width)(x)
            return x

    class Stacked(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = shardplug.stack.LinenLayers(Mlp, 4, name="layers")(nn.Dense(WIDTH)(x))
            return nn.Dense(1)(x)

    pp = shardplug.get_strategy("pp", schedule=schedule)
    got = [r["loss"] for r in trainer(Stacked(), pp, 4, **RULES).fit([batch()] * 2, steps=2)]
    want = [r["loss"] for r in trainer(Stacked(), "dp", 1, **RULES).fit([batch()] * 2, steps=2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
