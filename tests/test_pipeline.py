"""Pipeline parallelism (``pp``) and the layer stack: trajectories equal to one device's,
the stack's bytes and the schedule's traffic as explain reports them, resume across
strategies, and bad input in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplug
from shardplug.cli import main
from shardplug.errors import ConfigError, MeshError
from shardplug.planning.explain import explain
from shardplug.strategies.pp.stages import Pipeline, circular_order

STEPS = 3


def losses(rows):
    return np.array([r["loss"] for r in rows])


def train(strategy, adapter, layers, devices=8, mesh=None, steps=STEPS, **options):
    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter(adapter, layers=layers),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=shardplug.get_strategy(strategy, **options),
        devices=devices,
        mesh=mesh,
    )
    batches = model.batches(model.batch_size, 0)
    return trainer, losses(trainer.fit(batches, steps))


_REFERENCE = {}


def one_device(adapter, layers):
    if (adapter, layers) not in _REFERENCE:
        _REFERENCE[adapter, layers] = train("dp", adapter, layers, devices=1)[1]
    return _REFERENCE[adapter, layers]


# Each composition, GPipe and circular (the schedules that write the backward pass in are
# tests/test_schedules.py's); every adapter under pp+dp is the conformance suite's
# (tests/test_conformance.py, TestPipeline).
GPIPE = {"schedule": "gpipe"}
CASES = [
    ("pp", "stage=8", GPIPE, "nnx", 8),
    ("pp+fsdp+tp", "stage=2,fsdp=2,model=2", {"min_size": 0, **GPIPE}, "linen", 4),
    ("pp+dp", "stage=4,data=2", {"repeats": 2, "microbatches": 4, **GPIPE}, "nnx", 8),
    (
        "pp+fsdp+tp",
        "stage=2,fsdp=2,model=2",
        {"repeats": 2, "microbatches": 4, **GPIPE},
        "equinox",
        4,
    ),
]


@pytest.mark.parametrize(("strategy", "mesh", "options", "adapter", "layers"), CASES)
def test_pipeline_trains_like_one_device(strategy, mesh, options, adapter, layers):
    _, got = train(strategy, adapter, layers, mesh=mesh, **options)
    np.testing.assert_allclose(got, one_device(adapter, layers), rtol=1e-4)


def test_pipeline_with_gradient_accumulation_trains_like_one_device():
    # two accumulated microbatches, each run through the 4-stage pipeline in 4 of its own
    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter("nnx", layers=4),
        loss_fn=model.loss_fn,
        optimizer=optax.adam(model.learning_rate),
        strategy=shardplug.get_strategy("pp+dp", microbatches=4, schedule="gpipe"),
        mesh="stage=4,data=2",
        grad_accum=2,
    )
    got = losses(trainer.fit(model.batches(model.batch_size, 0), STEPS))
    np.testing.assert_allclose(got, one_device("nnx", 4), rtol=1e-4)


@pytest.fixture(scope="module")
def gpipe():
    """pp+dp on stage=4,data=2, 8 layers, 4 microbatches: explained."""
    model = shardplug.get_model("transformer")
    trainer, _ = train(
        "pp+dp", "nnx", 8, mesh="stage=4,data=2", steps=1, microbatches=4, schedule="gpipe"
    )
    return trainer, explain(trainer, next(model.batches(model.batch_size, 0)))


def test_each_stage_holds_its_share_of_the_stack(gpipe):
    _, report = gpipe
    pl = report.pipeline
    assert (pl["stages"], pl["microbatches"], pl["repeats"], pl["layers"]) == (4, 4, 1, 8)
    assert pl["stack_bytes_per_device"] * 4 == pl["stack_bytes"] > 0
    assert pl["stage_layers"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    wq = {p.path: p for p in report.params}["blocks/wq"]
    assert wq.spec == "P('stage',)" and wq.bytes_per_device * 4 == 8 * 64 * 4 * 16 * 4


def test_bubble_and_permutes_are_the_schedules(gpipe):
    _, report = gpipe
    pl = report.pipeline
    assert pl["bubble"] == pytest.approx(3 / (4 + 3))  # (S-1)/(R*M+S-1)
    assert Pipeline("stage", 4, 8, repeats=2).bubble == pytest.approx(3 / (16 + 3))
    cp = pl["collective_permute"]
    # one send forward and one back on each of 7 ticks, each a microbatch's stage input:
    # 32 rows / 4 microbatches / 2 data shards x 32 positions x 64 wide x 4 bytes
    assert cp["compiled_ops"] == cp["schedule_ops"] == 2 * 7
    assert cp["compiled_bytes_per_step"] == cp["textbook_bytes_per_step"] == 2 * 7 * 4 * 32 * 64 * 4


def test_circular_order_puts_non_adjacent_groups_on_each_stage():
    # 8 layers, 2 stages, 2 repeats: stage 0 holds groups 0 and 2 (layers 0,1 and 4,5)
    assert circular_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert circular_order(8, 4, 1).tolist() == list(range(8))


def test_the_stack_compiles_one_block_whatever_the_depth():
    model = shardplug.get_model("transformer")
    sizes = []
    batch = next(model.batches(2, 0))
    for layers in (2, 12):
        adapter = model.adapter("nnx", layers=layers)
        params, _ = adapter.abstract(jax.random.key(0))

        def loss(p, adapter=adapter):
            return model.loss_fn(
                adapter.bind(
                    p, adapter.abstract(jax.random.key(0))[1], rng=jax.random.key(0), train=True
                ),
                batch,
            )[0]

        text = jax.jit(jax.grad(loss)).lower(params).as_text()
        sizes.append(text.count("dot_general"))
    assert sizes[0] == sizes[1]  # a scan: the program does not grow with the layers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "pp", "--layers", "6"],
         "8 stages do not divide the layer stack's 6 layers"),
        (["--strategy", "pp+dp", "--mesh", "stage=4,data=2", "--layers", "4", "-o",
          "microbatches=5"], "5 microbatches do not divide the batch of 32"),
        (["--strategy", "pp+dp", "--mesh", "stage=4,data=2", "--layers", "8", "-o",
          "repeats=2", "-o", "microbatches=2"],
         "the circular schedule (repeats=2) needs microbatches a multiple of the 4 stages"),
        (["--strategy", "pp", "--model", "mlp"],
         "pp splits a layer stack over 'stage', and this model has none: build its blocks "
         "with shardplug.stack"),
        (["--strategy", "pp", "--mesh", "data=8"],
         "mesh axis 'data' is not an axis of this composition, whose axes are stage (pp)"),
        (["--strategy", "dp", "--model", "mlp", "--layers", "4"],
         "model 'mlp' takes no option 'layers'"),
    ],
)  # fmt: skip
def test_bad_pipeline_input_is_one_line(argv, message, capsys):
    assert main(["train", "--steps", "1", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardplug: error: ") and message in err and err.count("\n") == 1


def test_a_pipeline_error_in_python_is_typed():
    with pytest.raises(ConfigError, match="do not divide the layer stack's 6 layers"):
        train("pp", "nnx", 6, steps=1)
    with pytest.raises(MeshError):
        train("pp", "nnx", 8, mesh="data=8", steps=1)


def test_pp_checkpoints_resume_under_fsdp_on_4_devices_and_back(tmp_path, capsys):
    common = ["train", "--quiet", "--layers", "4", "--checkpoint-every", "4"]
    full, ckpt = tmp_path / "full.jsonl", tmp_path / "ckpt"
    pp = ["--strategy", "pp+fsdp", "--mesh", "stage=4,fsdp=2"]
    assert main(["train", "--quiet", "--layers", "4", *pp, "--steps", "12",
                 "--metrics-out", str(full)]) == 0  # fmt: skip
    out = tmp_path / "resumed.jsonl"
    base = [*common, "--checkpoint-dir", str(ckpt), "--metrics-out", str(out)]
    assert main([*base, *pp, "--steps", "4"]) == 0
    assert main([*base, "--resume", "--strategy", "fsdp", "--devices", "4", "--steps", "8"]) == 0
    assert main([*base, "--resume", *pp, "--steps", "12"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = [json.loads(line) for line in full.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    np.testing.assert_allclose(losses(rows), losses(want), rtol=1e-4)


def test_the_schedule_returns_each_layers_aux_summed_over_microbatches_in_layer_order():
    """A block's aux (a sum over its rows) comes back per layer, in the stack's order, as the
    plain scan's: circular (2 stages x 2 repeats of 2 layers), 4 microbatches, 2 replicas."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplug.core import ops
    from shardplug.core.operations.layer_stack import run_stack
    from shardplug.strategies.pp.stages import stack_operation

    def block(w, h):
        h = jnp.tanh(h * w[None, :])
        return h, {"rows": jnp.sum(h, axis=0), "count": jnp.sum(h > 0.0).astype(jnp.float32)}

    w = jnp.linspace(0.5, 1.5, 8 * 3).reshape(8, 3)
    x = jnp.linspace(-1.0, 2.0, 16 * 3).reshape(16, 3)
    want = run_stack(block, w, x)
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("stage", "data"), auto, devices=jax.devices()[:4])
    pipeline = Pipeline("stage", 2, 4, repeats=2, replicas=("data",), replica_size=2)

    @jax.jit
    def piped(w, x):
        with ops.override("layer_stack", stack_operation(pipeline)):
            return run_stack(block, w, x)

    with jax.set_mesh(mesh):
        w_ = jax.device_put(w, NamedSharding(mesh, P("stage")))
        got = piped(w_, jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for key in ("rows", "count"):
        np.testing.assert_allclose(got[1][key], want[1][key], rtol=1e-5, atol=1e-6)
