"""What the runtime's C++ writes to standard error: held back, or said in shardplug's words."""

import io
import threading

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.running.native import remat_note, sort, sorted_stderr

#: XLA's line, as the partitioner writes it (jax 0.10, CPU)
REMAT = (
    "W1126 15:20:16.952310    6970 spmd_partitioner.cc:656] [SPMD] Involuntary full "
    "rematerialization. The compiler cannot go from sharding {devices=[2,1,4]<=[4,2]T(1,0)} to "
    "{devices=[1,8,1]<=[8]} efficiently for HLO operation %add.2 = f32[8,16,4]{2,1,0} "
    'add(%param, %param), sharding={devices=[2,1,4]<=[4,2]T(1,0)}, metadata={op_name="jit(f)/'
    'add" stack_frame_id=2}. As the last resort, SPMD will replicate the tensor and then '
    "partition it to obtain the target sharding, which is inefficient.\n"
)
ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"


def _moved_whole():
    """A step XLA can only compile by gathering an array whole (jax-ml/jax#21562)."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    first, second = NamedSharding(mesh, P("y", None, "x")), NamedSharding(mesh, P(None, ("x", "y")))

    def f(a, b, c):
        return c + jax.lax.with_sharding_constraint(a + b, second)

    step = jax.jit(f, in_shardings=(first, first, second), out_shardings=second)
    x = jax.ShapeDtypeStruct((16, 16, 16), jnp.float32)
    return step.lower(x, x, x)


def test_each_line_is_sorted_and_the_spmd_line_is_said_in_one():
    other = "E0512 12:34:56.789012  1234 a.cc:1] hi\n"
    lines = (REMAT, ABSL, other, "loss 1\n")
    assert [sort(line) for line in lines] == ["remat", "absl", "native", ""]
    note = remat_note([REMAT, REMAT], "2d")
    assert note.startswith("shardplug: XLA moved 2 arrays between layouts by gathering each whole")
    assert "in 2d's step, first f32[8,16,4] at add: the step computes the same" in note


def test_launch_says_the_spmd_line_once_for_the_job_and_drops_absls_notice():
    from shardplug.running.launch import _stream

    lock, explained, outs = threading.Lock(), set(), []
    for rank in (0, 1):
        out, held, said = io.StringIO(), [], []
        _stream(rank, io.StringIO(ABSL + REMAT + REMAT + "shardplug: trained\n"), out, lock, held,
                said, explained)  # fmt: skip
        outs.append(out.getvalue().splitlines())
        assert held == [REMAT, REMAT]  # shown if the worker fails
    assert outs[0][0].startswith("[0] shardplug: XLA moved an array between layouts")
    assert outs[0][1:] == ["[0] shardplug: trained"] and outs[1] == ["[1] shardplug: trained"]


@pytest.fixture
def compiled_afresh(monkeypatch):
    """The tests' persistent compilation cache off (a program loaded from it is not
    partitioned again, so XLA says nothing), nothing said yet, every line not asked for."""
    from shardplug.core.cache import uncached
    from shardplug.running import native

    monkeypatch.setattr(native, "_EXPLAINED", set())
    monkeypatch.delenv("SHARDPLUG_TRACEBACK", raising=False)
    with uncached():
        yield


def test_in_one_process_xlas_lines_are_said_once_in_shardplugs_words(capfd, compiled_afresh):
    with sorted_stderr("mine"):
        _moved_whole().compile()
    err = capfd.readouterr().err
    assert "spmd_partitioner" not in err
    (line,) = err.splitlines()
    assert line.startswith("shardplug: XLA moved ") and "in mine's step" in line
    with sorted_stderr("mine"):  # said once for a step
        _moved_whole().compile()
    assert capfd.readouterr().err == ""
    _moved_whole().compile()  # outside: XLA's own line, as it writes it
    assert "[SPMD] Involuntary full rematerialization" in capfd.readouterr().err


def test_explain_says_xlas_spmd_line_in_shardplugs_words(capfd, compiled_afresh):
    """explain and recommend compile in this process: the partitioner's line, written by C++
    past Python's stderr, is held while the step compiles and said as one line of ours."""
    import numpy as np
    import optax
    from flax import nnx

    import shardplug
    from shardplug.planning.explain import explain

    class Moves(nnx.Module):  # jax-ml/jax#21562's constraints, on a (data, model) mesh
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((16, 16)))

        def __call__(self, x):
            h = jax.lax.with_sharding_constraint(x, P("model", None, "data"))
            return jax.lax.with_sharding_constraint(h + h, P(None, ("data", "model"))) @ self.w

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).mean()

    adapter = shardplug.from_nnx(Moves)
    trainer = shardplug.Trainer(
        adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1), strategy="2d", allocate=False
    )
    explain(trainer, {"x": np.ones((16, 16, 16), np.float32)})
    err = capfd.readouterr().err
    assert "spmd_partitioner" not in err
    assert "shardplug: XLA moved an array between layouts by gathering it whole" in err
    assert "in 2d's step, f32[8,16,4] at jvp()/add" in err
