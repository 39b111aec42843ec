"""Compositions: parallelisms on one mesh, by name, in the documented order, and refused
where they cannot compose."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import reference_trainer
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.cli import main
from shardplug.core import registry
from shardplug.core.context import manual_axes, per_device_program
from shardplug.errors import CompositionError, MeshError, UnknownStrategyError


def trainer(strategy, model_name="transformer", **kwargs):
    return reference_trainer(model_name, strategy, **kwargs)


def test_the_order_splits_tensor_dimensions_first_and_fsdp_what_remains():
    _, t = trainer("dp+fsdp+tp", mesh="data=2,fsdp=2,model=2")
    assert t.mesh.axis_names == ("data", "fsdp", "model")  # outer to inner
    block = t.param_shardings["blocks"]
    assert block["wi"].spec == P(None, "fsdp", "model")  # (layers, embed, mlp): tp takes mlp
    assert block["wf"].spec == P(None, "model", "fsdp")  # (layers, mlp, embed)
    assert t.param_shardings["embed"].spec == P("model", "fsdp")  # (vocab, embed)
    assert t.param_shardings["norm"]["scale"].spec == P()  # small: whole
    shard = t.state.params["blocks"]["wi"].addressable_shards[0].data
    assert shard.shape == (2, 64 // 2, 256 // 2)


def test_the_batch_splits_over_every_batch_axis_in_mesh_order():
    model, t = trainer("dp+fsdp", model_name="mlp")
    t.compile(next(model.batches(model.batch_size, 0)))
    assert t.batch_shardings["x"].spec == P(("data", "fsdp"))
    assert dict(t.mesh.shape) == {"data": 4, "fsdp": 2}


def test_constrain_maps_logical_names_by_the_runs_rules():
    class Probe(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x):
            return shardplug.constrain(self.w(x), ("batch", "mlp"))

    def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

    t = shardplug.Trainer(
        shardplug.from_nnx(Probe), loss_fn=loss_fn, optimizer=optax.sgd(0.1), strategy="fsdp+tp"
    )
    batch = {"x": np.ones((8, 8), np.float32)}
    hlo = t.lower(batch).as_text()
    assert re.search(r'sharding_constraint %\d+ <@mesh, \[\{"fsdp"\}, \{"model"\}\]>', hlo)
    assert registry.get_strategy("fsdp+tp").activation_rules() == {
        "batch": ("fsdp",),
        "mlp": ("model",),
        "heads": ("model",),
        "vocab": ("model",),
        "model": ("model",),
    }
    x = jnp.ones((4, 3))
    assert shardplug.constrain(x, ("batch", None)) is x  # outside a step: unchanged
    with per_device_program(("data",), manual=("data", "model")):
        assert manual_axes() == ("data", "model") and shardplug.batch_axis_name() == ("data",)
    with pytest.raises(shardplug.ConfigError, match="give one name"):
        shardplug.constrain(x, ("batch",))


# A model written the way Flax's "Scale up on multiple devices" guide writes one: its
# variables annotated with mesh axis names, a PartitionSpec inside its forward pass. The
# names here are those of Flax's FSDP + tensor-parallel examples, `fsdp` and `tp`.
class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, ("fsdp", "tp")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("tp", "fsdp"))

    def __call__(self, x):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("fsdp", "tp"))
        z = jnp.dot(y, self.w2[...])
        return z


def explicit_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def explicit_batches(steps=5, rows=16, depth=64):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, depth)).astype(np.float32),
            "y": rng.normal(size=(rows, depth)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def flax_single_device_losses(batches):
    """The model's own loop on one device, as Flax's guide runs it: under a mesh of its axes."""
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), nnx.use_eager_sharding(False):
        model = DotReluDot(64, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(explicit_loss)(model, batch)
            optimizer.update(model, grads)
            return loss

        return [float(step(model, optimizer, b)) for b in batches]


def test_a_model_that_names_its_mesh_axes_trains_under_fsdp_tp_unchanged():
    batches = explicit_batches()
    t = shardplug.Trainer(
        shardplug.from_nnx(lambda rngs: DotReluDot(64, rngs)),
        loss_fn=explicit_loss,
        optimizer=optax.adam(1e-2),
        strategy="fsdp+tp",
        mesh={"fsdp": 4, "tp": 2},
        axis_names={"model": "tp"},
    )
    assert t.mesh.axis_names == ("fsdp", "tp")
    assert t.param_shardings["dot1"]["kernel"].spec == P("fsdp", "tp")
    assert t.param_shardings["w2"].spec == P("tp", "fsdp")
    losses = [r["loss"] for r in t.fit(batches, steps=len(batches))]
    np.testing.assert_allclose(losses, flax_single_device_losses(batches), rtol=1e-4)


BAD = [
    ({"strategy": "fsdp+zero"}, UnknownStrategyError, "unknown parallelism 'zero'"),
    ({"strategy": "fsdp+pmap"}, CompositionError, "'pmap' is a whole strategy"),
    ({"strategy": "fsdp+tp", "mesh": "fsdp=4,model=4"}, MeshError, "has 16 devices but the run"),
    ({"strategy": "fsdp+tp", "mesh": "fsdp=4,tp=2"}, MeshError, "mesh axis 'tp' is not an axis"),
    ({"strategy": "fsdp+tp", "axis_names": {"stage": "s"}}, MeshError, "does not have"),
    ({"strategy": "2d+tp"}, CompositionError, "names 'tp' twice"),
    ({"strategy": "fsdp+"}, CompositionError, "malformed composition"),
    ({"strategy": "pmap", "axis_names": {"data": "d"}}, CompositionError, "lays out its own"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[k["strategy"] for k, *_ in BAD])
def test_bad_compositions_raise_typed_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        trainer(model_name="mlp", **kwargs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "fsdp+zero"], "unknown parallelism 'zero'"),
        (["--strategy", "dp+pmap"], "'pmap' is a whole strategy"),
        (["--strategy", "fsdp+tp", "--mesh", "fsdp=3,model=2"], "has 6 devices but the run"),
        (["--strategy", "fsdp+tp", "--mesh", "fsdp=4,tp=2"], "--axis-name ROLE=tp"),
        (["--strategy", "fsdp+tp", "--axis-name", "model"], "is not ROLE=NAME"),
    ],
)
def test_bad_compositions_on_the_command_line_are_one_line(args, message, capsys):
    assert main(["train", "--model", "mlp", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardplug: error: ") and message in err[0]


SAME_AXIS = '''
from shardplug.plugin import RANK, Axis, hookimpl

class Replicas:
    """Replicas: another parallelism on the `data` axis."""

    @hookimpl
    def parallel_axis(self):
        return Axis("data", rank=RANK["data"], batch=True)

class Rows:
    """Splits every parameter's first dimension over `rows`."""

    @hookimpl
    def parallel_axis(self):
        return Axis("rows", rank=35)

    @hookimpl
    def split_param(self, shape, size, taken):
        return 0 if shape and shape[0] % size == 0 else None
'''


def test_a_third_party_parallelism_composes_and_conflicts_are_named(tmp_path, monkeypatch, capsys):
    from tests.test_registry import install

    entry = {"replicas": "sameaxis:Replicas", "rows": "sameaxis:Rows"}
    install(tmp_path, monkeypatch, "sameaxis", "0.1", entry, {"sameaxis": SAME_AXIS})
    try:
        info = {i.name: i for i in shardplug.list_strategies()}
        assert (info["replicas"].kind, info["rows"].kind) == ("parallelism", "parallelism")
        with pytest.raises(CompositionError, match="'dp' and 'replicas' both claim the mesh axis"):
            shardplug.get_strategy("dp+replicas")
        assert main(["train", "--model", "mlp", "--quiet", "--strategy", "dp+replicas"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "both claim the mesh axis 'data'" in err[0]
        # rows claims dimension 0 after tp: the transformer's (vocab, embed) table is tp's
        with pytest.raises(CompositionError, match="'tp' and 'rows' both split dimension 0"):
            trainer("rows+tp", mesh="rows=4,model=2")
        _, t = trainer("dp+rows", model_name="mlp", mesh="data=2,rows=4")
        assert t.mesh.axis_names == ("data", "rows")
        rows = jax.tree.map(lambda s: s.spec, t.param_shardings)
        kernels = jax.tree.map(lambda p: p.shape, t.state.params)
        assert rows["fc1"]["kernel"] == (P("rows") if kernels["fc1"]["kernel"][0] % 4 == 0 else P())
    finally:
        registry._discover.cache_clear()


def test_explain_fsdp_tp_splits_parameters_over_all_eight_devices(capsys):
    import json

    reports = {}
    for strategy, mesh in (("dp", []), ("fsdp+tp", ["--mesh", "fsdp=4,model=2"])):
        assert main(["explain", "--strategy", strategy, *mesh, "--json"]) == 0
        reports[strategy] = json.loads(capsys.readouterr().out)
    dp, both = reports["dp"]["per_device"], reports["fsdp+tp"]["per_device"]
    for key in ("params_bytes", "opt_state_bytes"):
        assert both[key] <= 1.05 * dp[key] / 8, (key, both[key], dp[key] / 8)
    kinds = {c["kind"] for c in reports["fsdp+tp"]["collectives"]}
    assert {"all-gather", "all-reduce"} <= kinds
    assert any("tensor parallelism" in note for note in reports["fsdp+tp"]["notes"])
