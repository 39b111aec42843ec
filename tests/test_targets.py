"""The step compiled for a GPU that is not here (``explain --target``): with JAX's CUDA
plugin (CI installs it for this file alone, after the rest), the GPU compiler's program and
memory; without it, one line saying what to install."""

import importlib.util
import pathlib
import sys

import jax
import optax
import pytest

import shardplug
from shardplug.cli import main
from shardplug.core.compiled.targets import TARGETS, find_target, host_copies, target_devices
from shardplug.errors import ConfigError
from shardplug.planning.explain import explain

PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)
ROOT = pathlib.Path(__file__).parent.parent
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="JAX's CUDA plugin is not installed")
# which attention a GPU's program runs is said as a warning (and checked in a note below)
pytestmark = [pytest.mark.filterwarnings("ignore:shardplug.attention"),
              # JAX 0.12 deprecates Pallas' Triton backend, which core.flash's kernel runs on
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


def test_an_unknown_gpu_or_count_is_one_line(capsys):
    with pytest.raises(ConfigError, match=r"--target h900: not a GPU .* h100, h200, a100"):
        find_target("h900")
    assert main(["explain", "--target", "h900"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("shardplug: error: --target h900")
    with pytest.raises(ConfigError, match="multiple of 8"):
        target_devices("h100", 12)


@pytest.mark.skipif(PLUGIN, reason="JAX's CUDA plugin is installed")
def test_without_the_plugin_it_says_what_to_install(capsys):
    assert main(["explain", "--target", "h100", "--model", "mlp"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "needs JAX's CUDA plugin" in line and "pip install 'shardplug[target]'" in line


def _trainer(strategy, count, **kwargs):
    model = shardplug.get_model("transformer")
    return model, shardplug.Trainer(
        model.adapter("nnx", layers=2), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3),
        strategy=strategy, devices=target_devices("h100", count), allocate=False,
        precision="bfloat16", **kwargs,
    )  # fmt: skip


@needs_plugin
def test_the_step_is_the_gpu_compilers_program_and_memory():
    model, trainer = _trainer("fsdp", 2)
    report = explain(trainer, next(model.batches(8, 0)))
    assert {d.device_kind for d in trainer.mesh.devices.flat} == {TARGETS["h100"].kind}
    analysis = trainer.compiled.memory_analysis()
    mem = report.per_device
    a = analysis
    held = a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
    assert mem["peak_bytes"] == held + a.temp_size_in_bytes
    assert mem["device_memory_bytes"] == TARGETS["h100"].memory_bytes
    text = trainer.compiled.as_text()
    assert "is_scheduled=true" in text and "all-gather" in text and "__triton" in text  # a GPU's
    assert report.notes[0].startswith("compiled for 2 x NVIDIA H100 80GB HBM3, not present")
    # its time predicted from that program: the products, and the gathers fsdp runs
    timing = report.timing
    assert timing["chip"] == "h100" and timing["devices"] == 2 and timing["seconds"] > 0
    assert {"matmul bf16", "all-gather (local)"} <= set(timing["parts"])
    assert timing["seconds"] >= timing["compute_seconds"]
    # float32 master weights, computed in bfloat16 (the GPU's default precision)
    assert jax.tree.leaves(trainer.state.params)[0].dtype.name == "float32"


def _gpt_1b(*addons, options=None):
    """The 1B GPT of benchmarks/gpu_mfu.py (batch 16 x 1024, bf16 compute, AdamW) explained
    for one H100, under ``addons``."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_mfu

    task = gpu_mfu.task("1b")
    strategy = shardplug.get_strategy("dp", addons=list(addons), **(options or {}))
    trainer = shardplug.Trainer(
        task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer, strategy=strategy,
        devices=target_devices("h100", 1), allocate=False, precision="bf16",
    )  # fmt: skip
    return explain(trainer, gpu_mfu.batches(gpu_mfu.SIZES["1b"], 16, 1)[0]), trainer


@pytest.fixture(scope="module")
def gpt_1b():
    """The 1B GPT's H100 programs: plain, offload, offload with the parameters (each ~10 s)."""
    return {"plain": _gpt_1b(), "offload": _gpt_1b("offload"),
            "params": _gpt_1b("offload", options={"offload.params": True})}  # fmt: skip


#: the 1B GPT's device peak measured on one H100 80GB (benchmarks/gpu/h100_mfu_1b.json)
MEASURED_1B = 40.5598e9


@needs_plugin
def test_the_h100_program_of_the_1b_gpt_has_the_measured_peak(gpt_1b):
    report, trainer = gpt_1b["plain"]
    # cuDNN's fused attention, as the GPU runs it (not XLA's, whose scores cost 20 GB more)
    text = trainer.compiled.as_text()
    assert "__cudnn$fmhaSoftmaxBackward" in text
    assert not any("attention compiled as XLA's" in n for n in report.notes)
    assert abs(report.per_device["peak_bytes"] / MEASURED_1B - 1) < 0.006


@needs_plugin
def test_offload_frees_the_optimizer_state_in_the_h100_program(gpt_1b):
    plain = gpt_1b["plain"][0].per_device
    offload, trainer = gpt_1b["offload"]
    moved = offload.per_device
    assert moved["host_bytes"] == plain["opt_state_bytes"]
    assert plain["peak_bytes"] - moved["peak_bytes"] >= 8.0e9  # the bound
    assert plain["peak_bytes"] - moved["peak_bytes"] >= 0.99 * plain["opt_state_bytes"]
    # one parameter's state at a time (the embedding's, the largest), not the whole state
    assert moved["update_bytes"] == 2 * 4 * 50304 * 2048 + 4  # and Adam's step count
    copies, overlapping, first = host_copies(trainer.compiled.as_text())
    assert copies > 200 and overlapping >= copies - 3 and first > 0.25
    assert any("brings host memory to the device in" in n for n in offload.notes)
    params = gpt_1b["params"][0].per_device
    both = plain["opt_state_bytes"] + plain["params_bytes"]
    assert plain["peak_bytes"] - params["peak_bytes"] >= 0.97 * both


@needs_plugin
def test_offload_frees_memory_under_full_remat_in_the_h100_program():
    """The Llama example at 1B (16 layers of width 2048, sequence 1024), --remat full."""
    llama = _example("llama")
    config = llama.Config(layers=16, width=2048, heads=16, mlp=5632, vocab=32000,
                          sequence=1024, batch=16, remat="full")  # fmt: skip
    task = llama.task_of(config, "llama-1b")
    batch = next(iter(task.batches()))
    peaks = {}
    for addons in ((), ("offload",)):
        trainer = task.trainer(strategy=shardplug.get_strategy("dp", addons=list(addons)),
                               devices=target_devices("h100", 1), allocate=False,
                               precision="bf16")  # fmt: skip
        peaks[addons] = explain(trainer, batch).per_device
    plain, moved = peaks[()], peaks[("offload",)]
    assert plain["peak_bytes"] - moved["peak_bytes"] >= (
        plain["opt_state_bytes"] - moved["update_bytes"])


@needs_plugin
def test_the_update_on_the_host_is_refused_for_a_gpu_not_here_in_one_line():
    model, trainer = _trainer(
        shardplug.get_strategy("fsdp", addons=["offload"], **{"offload.update": "host"}), 2
    )
    with pytest.raises(ConfigError, match="fails on offload's update=host") as caught:
        explain(trainer, next(model.batches(8, 0)))
    assert "\n" not in str(caught.value)


@needs_plugin
def test_the_command_line_explains_for_a_named_gpu(capsys):
    assert main(["explain", "--target", "h100", "--devices", "2", "--strategy", "fsdp",
                 "--model", "mlp", "--json"]) == 0  # fmt: skip
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["per_device"]["device_memory_bytes"] == TARGETS["h100"].memory_bytes
    assert any(n.startswith("compiled for 2 x NVIDIA H100") for n in report["notes"])


def _example(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example",
                                                  ROOT / "examples" / "tasks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@needs_plugin
def test_recommend_plans_for_a_named_gpu(capsys):
    assert main(["recommend", "--target", "h100", "--devices", "2", "--strategies", "dp,fsdp",
                 "--model", "mlp"]) == 0  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    # the GPU's memory, not the CPU's (which has no limit: --device-memory is needed there)
    assert "on 2 devices of 85.0 GB (compiled for NVIDIA H100 80GB HBM3, not present)" in out
    assert "recommended: " in out
    # an H100 multiplies float8: recommend says the add-on that runs the products in it
    assert "NVIDIA H100 80GB HBM3 multiplies float8: add --addon float8" in out


@needs_plugin
def test_a_layout_cudnns_partitioner_cannot_split_takes_xlas_attention_said():
    """JAX's cuDNN attention partitioner fails on pp+fsdp's layout (a GSPMDSharding has no
    spec): the step compiles with XLA's attention, and the report says why."""
    llama = _example("llama")
    task = llama.tiny()
    trainer = task.trainer(strategy="pp+fsdp", devices=target_devices("h100", 8),
                           mesh="stage=2", allocate=False, precision="bf16")  # fmt: skip
    report = explain(trainer, next(iter(task.batches())))
    assert any("JAX's cuDNN partitioner failed on this layout" in n for n in report.notes)
    assert "__cudnn$fmha" not in trainer.compiled.as_text()


@needs_plugin
def test_the_gpu_benchmark_plans_for_a_named_gpu():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_mfu

    result = gpu_mfu.main(["--plan", "--target", "h100", "--sizes", "125m", "--batch", "8"])
    assert result["device"] == TARGETS["h100"].kind
    assert result["device_memory"] == TARGETS["h100"].memory_bytes
    assert result["largest_that_fits"] == "125m"


@needs_plugin
def test_the_calibration_script_puts_prediction_beside_the_h100s_measure():
    spec = importlib.util.spec_from_file_location("target_memory",
                                                  ROOT / "benchmarks" / "target_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (row,) = module.main(["--cases", "125m"])["cases"]
    assert row["measured_peak_bytes"] == 24306889728  # benchmarks/gpu/h100_mfu_125m.json
    assert abs(row["predicted_over_measured"] - 1) < 0.006


@needs_plugin
def test_packed_documents_take_the_fused_kernel_in_the_h100_program(tmp_path):
    """Packed rows (segment ids) of a Llama-shaped model compile for an H100 to Pallas'
    Triton flash kernel, not a score matrix: the temporaries grow linearly in the sequence
    (XLA's masked attention's grow with its square) and stay near the padded step's, which
    runs cuDNN's fused kernel."""
    import json

    from shardplug import pretrained

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import packing

    config = json.loads((ROOT / "tests" / "fixtures" / "hf" / "llama" / "config.json").read_text())
    config.update(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=1000,
                  max_position_embeddings=65536)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    task = pretrained.load(tmp_path).task("nnx")
    temps = {}
    for length in (4096, 16384):
        docs = packing.documents(length // 8, 512, length, 1000)
        for name, rows in (("packed", packing.packed_rows), ("padded", packing.padded_rows)):
            if name == "padded" and length != 4096:
                continue
            trainer = task.trainer(strategy="dp", devices=target_devices("h100", 1),
                                   allocate=False, precision="bf16")  # fmt: skip
            report = explain(trainer, rows(docs, length, 1))
            temps[name, length] = report.per_device["temp_bytes"]
            text = trainer.compiled.as_text()
            if name == "packed":
                assert "__gpu$xla.gpu.triton" in text and "__cudnn$fmha" not in text
    assert temps["packed", 16384] / temps["packed", 4096] < 4.4  # 4x the tokens: linear
    assert temps["packed", 4096] < 1.15 * temps["padded", 4096]
    # split over two GPUs (rows and heads: fsdp+tp), each runs the kernel on its share
    docs = packing.documents(4096 // 4, 512, 4096, 1000)
    trainer = task.trainer(strategy="fsdp+tp", devices=target_devices("h100", 2),
                           allocate=False, precision="bf16")  # fmt: skip
    explain(trainer, packing.packed_rows(docs, 4096, 2))
    assert "__gpu$xla.gpu.triton" in trainer.compiled.as_text()
    # the sequence split over two (cp's Ulysses): each runs the kernel on its heads' share
    trainer = task.trainer(strategy=shardplug.get_strategy("fsdp+cp", **{"cp.scheme": "ulysses"}),
                           devices=target_devices("h100", 4), allocate=False, precision="bf16",
                           mesh="fsdp=2,context=2")  # fmt: skip
    explain(trainer, packing.packed_rows(docs, 4096, 2))
    assert "__gpu$xla.gpu.triton" in trainer.compiled.as_text()
    # round a ring (cp's default): each block pair meets in the fused pair kernel, linearly
    ring = {}
    for length in (4096, 16384):
        docs = packing.documents(length // 4, 512, length, 1000)
        trainer = task.trainer(strategy="fsdp+cp", devices=target_devices("h100", 4),
                               allocate=False, precision="bf16",
                               mesh="fsdp=2,context=2")  # fmt: skip
        ring[length] = explain(trainer, packing.packed_rows(docs, length, 2)).per_device
        text = trainer.compiled.as_text()
        assert "shardplug_pair_forward" in text and "shardplug_pair_dkv" in text
    # XLA's block pairs made 2.3 GiB at 4096 and 33.7 GiB at 16384 (their scores whole)
    assert ring[16384]["temp_bytes"] / ring[4096]["temp_bytes"] < 4.4
    assert ring[4096]["temp_bytes"] < 400 * 2**20


@needs_plugin
def test_remat_offload_compiles_for_a_gpu_not_here_and_its_moves_cross_pcie():
    """--remat offload's moves stay in the GPU's program: each layer's input written into a
    stack of them in host memory in the forward pass and read back in the backward, a
    layer's worth each way (the predicted step's host copies), and the device's
    temporaries lower than --remat full's by that stack."""
    model = shardplug.get_model("transformer")
    reports = {}
    for policy in ("full", "offload"):
        trainer = shardplug.Trainer(
            model.adapter("nnx", layers=2, remat=policy), loss_fn=model.loss_fn,
            optimizer=optax.adam(1e-3), strategy="dp", devices=target_devices("h100", 1),
            allocate=False, precision="bfloat16",
        )  # fmt: skip
        reports[policy] = explain(trainer, next(model.batches(8, 0)))
    offload = reports["offload"]
    assert any(n.startswith("--remat offload: the GPU's program writes") for n in offload.notes)
    layer_input = 8 * 32 * 64 * 2  # a layer's input: 8 rows of 32 tokens of width 64, bf16
    parts = offload.timing["parts"]
    assert parts["host copies (to host)"]["bytes"] == 2 * layer_input
    assert parts["host copies (to device)"]["bytes"] == 2 * layer_input
    assert "host copies (to host)" not in reports["full"].timing["parts"]
    full, moved = (reports[p].per_device["temp_bytes"] for p in ("full", "offload"))
    assert moved <= full - 2 * layer_input


@needs_plugin
def test_float8_products_are_float8_gemms_in_the_h100_program():
    """A float8 product and its two gradients compile to GEMMs of float8 operands; the
    pattern that casts float8 back to bfloat16 before the product (dequantize, then
    multiply) becomes a bfloat16 GEMM: the trap shardplug.finetuning.float8 never writes."""
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from shardplug.core.compiled.targets import as_present
    from shardplug.finetuning.float8 import float8_dot_general, gemms

    device = target_devices("h100", 1)[0]
    place = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=place)
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=place)
    numbers = (((1,), (0,)), ((), ()))

    def compiled(product):
        def loss(x, w):
            y = product(jnp.tanh(x), w).astype(jnp.float32)
            return jnp.square(y - 1).sum()

        with as_present(device):
            return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()

    for scaling in ("tensor", "row"):
        found = gemms(compiled(lambda a, b, s=scaling: float8_dot_general(
            a, b, numbers, scaling=s, preferred_element_type=jnp.bfloat16)))  # fmt: skip
        # the forward e4m3 by e4m3, each gradient's e5m2 by e4m3 (in either order)
        assert {tuple(sorted(d)) for d in found} == {("f8e4m3fn", "f8e4m3fn"),
                                                     ("f8e4m3fn", "f8e5m2")}, (scaling, found)
        assert len(found) == 3

    def dequantized(a, b):  # float8 values multiplied as bfloat16: no float8 GEMM is left
        a8, b8 = (v.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16) for v in (a, b))
        return jax.lax.dot_general(a8, b8, numbers)

    widened = gemms(compiled(dequantized))
    assert len(widened) == 3 and all(d == ("bf16", "bf16") for d in widened), widened


@needs_plugin
def test_a_gpu_program_compiles_twice_with_a_persistent_cache_set(own_cache):
    """JAX writes a compile-only GPU's program to its persistent cache and cannot load it
    back: what compiles under ``as_present`` (bench --plan's twin, the benchmarks' own
    hand-written steps) stays out of it, so a second compile of the same program is a
    compile, not a failed load (CI's failure when two tests compiled the same twin)."""
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from shardplug.core.compiled.targets import as_present

    device = target_devices("h100", 1)[0]
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=SingleDeviceSharding(device))
    for _ in range(2):
        with as_present(device):
            text = jax.jit(lambda a: jnp.tanh(a @ a)).lower(x).compile().as_text()
        assert "__cublas" in text or "dot(" in text
    assert not list(own_cache.iterdir())  # nothing written that could not be read
    assert jax.config.jax_enable_compilation_cache  # the cache is on again after


@needs_plugin
def test_the_pair_kernel_compiles_for_an_h100_on_blocks_of_any_multiple_of_16():
    """Queries and keys of 96 and 48 positions (a ring's dealt half-blocks): Triton's
    program for an H100, forward and backward, in tiles of powers of two."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplug.core.compiled.targets import as_present
    from shardplug.core.operations.flash_pairs import pair_attention

    devices = target_devices("h100", 1)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    whole = NamedSharding(mesh, P())

    def shaped(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

    def loss(q, k, v, qi, ki, qp, kp):
        out, lse = pair_attention(q, k, v, qi, ki, qp, kp, causal=True, scale=0.125)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    args = (shaped((2, 96, 4, 64)), shaped((2, 48, 2, 64)), shaped((2, 48, 2, 64)),
            shaped((2, 96), jnp.int32), shaped((2, 48), jnp.int32), shaped((96,), jnp.int32),
            shaped((48,), jnp.int32))  # fmt: skip
    with jax.set_mesh(mesh), as_present(devices[0]):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    assert "shardplug_pair_forward" in text and "shardplug_pair_dq" in text


@needs_plugin
def test_the_float8_addons_step_runs_its_targets_as_float8_gemms_in_the_h100_program():
    """The reference transformer's step compiled for an H100, with and without
    ``--addon float8``: as many GEMMs, every one of the targets' float8 (the forward e4m3
    by e4m3, the gradients e5m2 by e4m3; no float8 value widened to a bfloat16 GEMM), the
    output head's three (not a target) bfloat16."""
    from collections import Counter

    from shardplug.finetuning.float8 import gemms

    task = shardplug.get_model("transformer").task("nnx")
    batch = next(iter(task.batches()))
    found = {}
    for addons in ((), ("float8",)):
        trainer = task.trainer(strategy=shardplug.get_strategy("dp", addons=list(addons)),
                               devices=target_devices("h100", 1), allocate=False,
                               precision="bf16")  # fmt: skip
        explain(trainer, batch)
        found[addons] = Counter(tuple(sorted(d)) for d in gemms(trainer.compiled.as_text()))
    plain, float8 = found[()], found[("float8",)]
    assert set(plain) == {("bf16", "bf16")}
    assert sum(float8.values()) == plain["bf16", "bf16"] and float8["bf16", "bf16"] == 3
    assert float8["f8e4m3fn", "f8e4m3fn"] >= 4 and float8["f8e4m3fn", "f8e5m2"] >= 8


@pytest.mark.skipif(not PLUGIN, reason="JAX's CUDA plugin is not installed")
def test_float8s_default_takes_every_linear_layer_of_the_gpt_and_leaves_its_head():
    """benchmarks/gpu_mfu.py's GPT names its attention's output projection ``out``: chosen by
    name, float8 left it (and its two gradients) bfloat16. Chosen from the traced step, in
    the H100 program every block's four linear layers multiply in float8, forward and
    backward, and the head ``unembed`` (its output the logits the loss reads) in bfloat16."""
    from collections import Counter

    from shardplug.finetuning.float8 import gemms

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_mfu

    size = gpu_mfu.SIZES["smoke"]
    task = gpu_mfu.task("smoke")
    trainer = shardplug.Trainer(task.adapter, loss_fn=task.loss_fn, optimizer=task.optimizer,
                                strategy=shardplug.get_strategy("dp", addons=["float8"]),
                                devices=target_devices("h100", 1), allocate=False,
                                precision="bf16")  # fmt: skip
    report = explain(trainer, gpu_mfu.batches(size, size.batch, 1)[0])
    found = Counter(tuple(sorted(d)) for d in gemms(trainer.compiled.as_text()))
    layers = size.layers
    assert found["f8e4m3fn", "f8e4m3fn"] == 4 * layers  # qkv, out, up, down: forward
    assert found["f8e4m3fn", "f8e5m2"] == 8 * layers  # and their two gradients
    held = report.precision["held"]["float8"]
    assert sorted({p.split("/")[-2] for p in held}) == ["down", "out", "qkv", "up"]
    assert not any("unembed" in p or "embed" in p.split("/")[0] for p in held)


def _record():
    import json

    return json.loads((ROOT / "benchmarks" / "gpu" / "h100_target_time.json").read_text())


def test_every_h100_step_on_record_is_predicted_within_10_percent():
    """benchmarks/target_time.py's fit: two constants, each solved on one point; every other
    point (the GPTs of three sizes, shardplug's and by hand; the pipeline engines at M = 8
    and 16) is a check, and every one lands within 10% of what the H100 measured."""
    record = _record()
    points = record["points"]
    held = [p for p in points if not p["in_fit"]]
    assert {p["point"] for p in points if p["in_fit"]} == set(record["fitted_on"].values())
    assert len(held) >= 12
    assert all(abs(p["error"]) < 0.10 for p in points), [
        (p["point"], round(p["error"], 3)) for p in points if abs(p["error"]) >= 0.10
    ]
    on_record = {p["file"] for p in points}
    timed = {f.name for f in (ROOT / "benchmarks" / "gpu").glob("h100_*.json")
             if "step_seconds" in f.read_text() or "step_ms" in f.read_text()}  # fmt: skip
    assert timed <= on_record  # every H100 step time the project holds is checked


@needs_plugin
def test_the_record_is_what_the_predictor_says_today():
    """One held-out point compiled again here and predicted: the JSON is today's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import target_time

    point = "gpt-125m hand_written"
    found = next(p for p in target_time.points() if p["point"] == point)
    seconds = shardplug.predict_step(found["compile"]()).seconds
    recorded = next(p for p in _record()["points"] if p["point"] == point)
    assert seconds == pytest.approx(recorded["predicted_seconds"], rel=1e-3)
    assert abs(seconds / recorded["measured_seconds"] - 1) < 0.10
