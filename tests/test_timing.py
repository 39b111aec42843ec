"""The step time predicted from a compiled program (``shardplug.predict_step``): its
structure checked on programs whose answer is known by hand. How close it comes to a GPU's
measured steps is tests/test_targets.py's (with the GPU compiler) and
benchmarks/target_time.py's; to a CPU's, benchmarks/cpu_time.py's."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.compiled.chips import CALIBRATION, CHIPS, Chip, calibrated
from shardplug.core.compiled.timing import program_text
from shardplug.errors import ConfigError

#: a chip whose arithmetic is easy: 1 TFLOP/s of f32 products, nothing else costs
PLAIN = Chip("plain", flops={"f32": 1e12}, vector=1e18, special=1e18, bandwidth=1e18,
             links={"local": 1e9, "network": 1e8}, pcie=1e9, launch_seconds=0.0,
             loop_seconds=0.0, gemm_efficiency=1.0, memory_efficiency=1.0,
             latency={"local": 0.0, "network": 0.0})  # fmt: skip
N = 256
PRODUCT = 2 * N**3 / 1e12  # one N x N x N product's seconds on PLAIN


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_a_loop_takes_the_branch_each_iteration_picks():
    """Each iteration's branch is computed from the loop's counter: 5 iterations of three
    products and 5 of one, not 10 of the longest branch."""

    def step(x, w):
        def heavy(x):
            return jnp.tanh(jnp.tanh(jnp.tanh(x @ w) @ w) @ w)

        def light(x):
            return jnp.tanh(x @ w)

        return lax.fori_loop(0, 10, lambda i, x: lax.switch(i % 2, [heavy, light], x), x)

    x = jnp.ones((N, N))
    found = shardplug.predict_step(_compiled(step, x, x), PLAIN)
    assert found.unresolved == 0
    assert found.parts["matmul f32"]["count"] == 20
    assert found.parts["matmul f32"]["flops"] == pytest.approx(20 * 2 * N**3)
    assert found.seconds == pytest.approx(20 * PRODUCT, rel=1e-3)


def test_devices_wait_for_the_slowest():
    """A branch picked by the device's own index (a pipeline's stages): the step takes as
    long as the device with the most work."""
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_device(x, w):
        heavy = lambda x: jnp.tanh(jnp.tanh(x @ w) @ w)  # noqa: E731
        return lax.switch(lax.axis_index("d"), [heavy, lambda x: jnp.tanh(x @ w)], x)

    step = jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    x, w = jnp.ones((2 * N, N)), jnp.ones((N, N))
    found = shardplug.predict_step(_compiled(step, x, w), PLAIN)
    assert found.unresolved == 0
    assert found.seconds == pytest.approx(2 * PRODUCT, rel=1e-3)


_OVERLAP = """HloModule overlap, is_scheduled=true, num_partitions=8

ENTRY %main (p0: f32[128,1024], p1: f32[1024,1024]) -> (f32[1024,1024], f32[1024,1024]) {
  %p0 = f32[128,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  %ag = (f32[128,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%p0), replica_groups=[1,8]<=[8], dimensions={0}
  %dot = f32[1024,1024]{1,0} dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %done = f32[1024,1024]{1,0} all-gather-done(%ag)
  ROOT %out = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%done, %dot)
}
"""  # noqa: E501


@pytest.mark.parametrize("link", [1e9, 1e6])
def test_communication_the_schedule_overlaps_is_hidden(link):
    """An all-gather started before a product and waited for after it costs the step only
    what the product does not cover: its ring's bytes, (g-1)/g of the result, over the link."""
    chip = dataclasses.replace(PLAIN, links={"local": link, "network": link})
    found = shardplug.predict_step(_OVERLAP, chip)
    gather = 7 / 8 * 1024 * 1024 * 4 / link
    product = 2 * 1024**3 / 1e12
    assert found.seconds == pytest.approx(max(gather, product), rel=1e-6)
    part = found.parts["all-gather (local)"]
    assert part["seconds"] == pytest.approx(gather)
    assert part["exposed"] == pytest.approx(max(0.0, gather - product), abs=1e-12)


def test_groups_across_hosts_go_over_the_network():
    """16 devices in hosts of 8: a gather over all of them crosses hosts."""
    text = _OVERLAP.replace("num_partitions=8", "num_partitions=16").replace(
        "[1,8]<=[8]", "[1,16]<=[16]"
    ).replace("f32[128,1024]", "f32[64,1024]")  # fmt: skip
    found = shardplug.predict_step(text, PLAIN)
    assert set(found.parts) >= {"all-gather (network)"}
    assert found.parts["all-gather (network)"]["seconds"] == pytest.approx(
        15 / 16 * 1024 * 1024 * 4 / PLAIN.links["network"]
    )


def test_a_tuned_product_runs_in_waves_of_tiles():
    """A product whose tiles fill the chip's cores once takes one wave; one tile more, and
    the autotuner's best tile decides: never less than the ideal, never more than two waves."""
    from shardplug.core.compiled.kernel_time import Kernels

    chip = dataclasses.replace(calibrated("h100"), launch_seconds=0.0)
    predictor = Kernels(None, chip)
    ideal = chip.peak("bf16") * chip.gemm_efficiency
    full = 128 * 12 * 256 * 11  # 132 tiles of 128 x 256: one wave
    seconds = predictor.gemm_seconds(128 * 12, 256 * 11, 4096, 1, "bf16", 0.0)
    assert seconds == pytest.approx(2 * full * 4096 / ideal)
    more = predictor.gemm_seconds(128 * 12 + 1, 256 * 11, 4096, 1, "bf16", 0.0)
    assert seconds < more <= 2 * seconds
    thin = predictor.gemm_seconds(4096, 4096, 16, 1, "bf16", 3 * 4096 * 4096 * 2)
    assert thin == pytest.approx(3 * 4096 * 4096 * 2 / (chip.bandwidth * chip.memory_efficiency))


def test_the_chip_is_named_or_read_from_the_program():
    x = jnp.ones((8, 8))
    compiled = _compiled(lambda x: x @ x, x)
    with pytest.raises(ConfigError, match="not compiled for a GPU shardplug knows"):
        shardplug.predict_step(compiled)
    with pytest.raises(ConfigError, match=r"no chip 'h900'; choose one of h100, h200, a100"):
        shardplug.predict_step(compiled, "h900")
    assert shardplug.predict_step(compiled, "h100").chip == "h100"
    assert "constant" in program_text(compiled) or "dot" in program_text(compiled)


def test_the_calibration_is_the_h100s_fit():
    """The fitted constants are those benchmarks/target_time.py solved (its JSON says on
    which points); the H200 shares them, with its own bandwidth."""
    import json
    import pathlib

    record = json.loads((pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu"
                         / "h100_target_time.json").read_text())  # fmt: skip
    assert record["fitted"] == CALIBRATION
    assert len(record["fitted_on"]) == len(CALIBRATION)
    h200 = calibrated("h200")
    assert h200.gemm_efficiency == CALIBRATION["gemm_efficiency"]
    assert h200.bandwidth == CHIPS["h200"].bandwidth > CHIPS["h100"].bandwidth
    assert math.isclose(calibrated("h100").peak("f8"), 2 * calibrated("h100").peak("bf16"),
                        rel_tol=1e-3)  # fmt: skip
