"""explain, recommend and bench: what a strategy costs, read off the compiled step."""

import json
import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.cli import main
from shardplug.core.compiled.hlo import collectives, wire_bytes
from shardplug.errors import ConfigError
from shardplug.planning.explain import explain

KEYS = {"params_bytes", "opt_state_bytes", "grads_bytes", "temp_bytes"}


@pytest.fixture(scope="module")
def reports():
    model = shardplug.get_model("transformer")
    batch = next(model.batches(model.batch_size, 0))
    out = {}
    for strategy in ("dp", "fsdp", "2d"):
        trainer = shardplug.Trainer(
            model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3),
            strategy=strategy,
        )  # fmt: skip
        out[strategy] = explain(trainer, batch)
    return out


def test_fsdp_holds_an_eighth_of_dp_per_device(reports):
    dp, fsdp = reports["dp"].per_device, reports["fsdp"].per_device
    for key in ("params_bytes", "opt_state_bytes"):
        assert fsdp[key] == pytest.approx(dp[key] / 8, rel=0.05)
        assert fsdp[key] > dp[key] / 8  # the small parameters stay whole: a little over
    assert dp["params_bytes"] == sum(p.bytes_per_device for p in reports["dp"].params)
    for report in reports.values():
        assert report.per_device.keys() >= KEYS and report.per_device["temp_bytes"] > 0
        assert report.per_device["peak_bytes"] > report.per_device["params_bytes"]


def test_collectives_match_the_textbook(reports):
    dp, fsdp = reports["dp"], reports["fsdp"]
    # data parallel: one all-reduce of the gradients (+4 bytes: the loss)
    assert [c["kind"] for c in dp.collectives] == ["all-reduce"]
    assert dp.collective_bytes("all-reduce") == pytest.approx(dp.textbook_bytes(), rel=1e-3)
    # fsdp: the layer stack gathered layer by layer in the forward scan and again in the
    # backward one, as the textbook says; the compiler gathers the embeddings and head once
    # for both and all-reduces the gradients; on the wire that is what 2 all-gathers and a
    # reduce-scatter send
    stack = sum(
        p.bytes_per_device * 8 for p in fsdp.params
        if p.path.startswith("blocks/") and not p.replicated
    )  # fmt: skip
    assert fsdp.collective_bytes("all-gather") == pytest.approx(
        fsdp.textbook_bytes("all-gather") / 2 + stack, rel=0.01
    )
    assert dp.wire_bytes() == pytest.approx(dp.textbook_wire_bytes(), rel=0.10)
    # the stack's gradients all-reduced where a reduce-scatter would do (XLA's CPU backend):
    # twice a reduce-scatter's bytes for them, on top of the textbook
    assert fsdp.textbook_wire_bytes() < fsdp.wire_bytes() < 1.5 * fsdp.textbook_wire_bytes()
    assert any("sends what 2 all-gathers" in note for note in fsdp.notes)
    # 2d: the activation all-reduces of tensor parallelism come on top, and are said to
    two_d = reports["2d"]
    assert two_d.wire_bytes() > 2 * two_d.textbook_wire_bytes()
    assert any("tensor parallelism" in note for note in two_d.notes)


def test_each_replicated_parameter_says_why(reports):
    why = {r: {p.path: p.why for p in reports[r].params} for r in reports}
    assert why["dp"]["embed"] == "dp keeps every parameter whole on every device"
    assert why["fsdp"]["norm/scale"].startswith("small: 64 elements")
    assert why["2d"]["norm/scale"] == "the rule splits none of its logical axes ('embed',)"
    assert why["fsdp"]["embed"] is None  # split, so nothing to explain
    split = {p.path: p.spec for p in reports["2d"].params}
    assert split["blocks/wi"] == "P(None, None, 'model')"


def test_pictures_show_every_device_once_per_block(reports):
    batch, param = reports["fsdp"].pictures
    assert batch["name"] == "targets" and param["name"] == "blocks/wf"
    assert sorted(i for block in batch["blocks"] for i in block[2]) == list(range(8))
    two_d_param = reports["2d"].pictures[1]
    assert [ids for _, _, ids in two_d_param["blocks"]] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_hlo_wire_bytes_follow_the_groups():
    text = """HloModule m, num_partitions=8
  %a = f32[100]{0} all-reduce(f32[100]{0} %x), replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %b = f32[80]{0} all-gather(f32[10]{0} %y), replica_groups=[1,8]<=[8], dimensions={0}
  %c = f32[10]{0} reduce-scatter(f32[80]{0} %z), replica_groups={}, dimensions={0}
  %d = f32[40]{0} all-to-all(f32[40]{0} %w), replica_groups=mesh['data'=2,'context'=4] {'context'}
  %e = f32[8]{0} collective-permute(f32[8]{0} %v), source_target_pairs={{0,1},{1,0}}
"""
    found = {c.kind: c for c in collectives(text)}
    assert found["all-reduce"].wire_bytes == round(wire_bytes("all-reduce", 400, 2)) == 400
    assert found["all-gather"].wire_bytes == 280  # 7/8 of 320 bytes
    assert found["reduce-scatter"].wire_bytes == 280  # 7 x 40 bytes
    assert found["all-to-all"].wire_bytes == 120  # 3/4 of 160 bytes: a group of 4, not 8
    assert found["collective-permute"].wire_bytes == 32


def test_hlo_groups_read_as_the_running_xla_prints_them():
    """The collective's group as the installed XLA writes it (a list before JAX 0.11, the
    mesh's axes after): a group of 4 over ``context``, 2 over ``data``, of 8 devices."""
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])  # fmt: skip
    spec = P("data", "context")

    def both(a):
        gathered = jax.lax.all_gather(a, "data", tiled=True)
        return jax.lax.psum(a, "context") + gathered.sum(0, keepdims=True)

    x = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, spec))
    program = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=spec))
    found = {c.kind: c for c in collectives(program.lower(x).compile().as_text())}
    assert found["all-reduce"].wire_bytes == 2 * 3 / 4 * 4 * 2 * 4  # f32[4,2] over 4
    assert found["all-gather"].wire_bytes == 1 / 2 * 8 * 2 * 4  # f32[8,2] gathered over 2


def test_cli_explain_json_and_plot(tmp_path, capsys):
    png = tmp_path / "layout.png"
    assert main(["explain", "--strategy", "fsdp", "--model", "mlp", "--json",
                 "--plot", str(png), "--device-memory", "1GB"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["per_device"].keys() >= KEYS
    assert report["per_device"]["device_memory_bytes"] == 10**9
    assert {"kind", "count", "bytes"} <= report["collectives"][0].keys()
    assert {"path", "shape", "spec", "bytes_per_device", "why"} <= report["params"][0].keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["explain", "--model", "mlp", "--param", "fc1/kernel"]) == 0
    out = capsys.readouterr().out
    assert "memory per device" in out and "fc1/kernel" in out and "textbook" in out


def test_explain_bad_input_is_one_line(capsys):
    assert main(["explain", "--model", "mlp", "--param", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardplug: error: no parameter 'nope'; the parameters are: ")
    assert len(err.strip().splitlines()) == 1
    assert main(["recommend", "--model", "mlp", "--device-memory", "lots"]) == 2
    assert "expected a size such as 80GB or 512MiB, got 'lots'" in capsys.readouterr().err
    assert main(["bench", "--strategies", "dp,nope", "--model", "mlp"]) == 2
    assert "unknown strategy 'nope'" in capsys.readouterr().err
    assert main(["recommend", "--model", "mlp"]) == 2  # a CPU has no memory figure to read
    assert capsys.readouterr().err == (
        "shardplug: error: --device-memory: the CPU backend gives no memory limit; say how "
        "much each device has, e.g. --device-memory 80GB\n"
    )


def test_on_one_device_recommend_takes_the_plainest_step(make_trainer):
    """Nothing is sent on one device: a pipeline's microbatches lower the peak but only slow
    the step, so the plain step wins, and the reason says why."""
    from shardplug.planning.recommend import recommend

    batch = next(iter(shardplug.get_model("transformer").batches(batch_size=8, seed=0)))

    def compile_trainer(name):
        return make_trainer("transformer", name, devices=1, allocate=False)[1], batch

    result = recommend(compile_trainer, 80 * 10**9, strategies=["cp", "pp", "dp", "fsdp"])
    rows = {r["strategy"]: r for r in result["strategies"]}
    assert rows["cp"]["fits"]  # fits as well, first in the list; but it brings a ring for nothing
    assert rows["pp"]["pipelined"] and rows["pp"]["peak_bytes"] < rows["dp"]["peak_bytes"]
    assert result["recommended"] == "dp"
    assert result["reason"].startswith("one device: no strategy splits or sends anything")


def test_recommend_never_picks_a_strategy_that_divides_nothing_and_breaks_ties_plainly(capsys):
    """A model of Flax's stock layers has no axis names: tensor parallelism finds nothing to
    split and would run the whole step on every device; pmap sends what dp sends."""
    from flax import nnx

    from shardplug.planning.recommend import recommend

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    batch = {"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 4), np.float32)}

    def compile_trainer(name):
        trainer = shardplug.Trainer(shardplug.from_nnx(Plain), loss_fn=loss_fn,
                                    optimizer=optax.sgd(0.1), strategy=name,
                                    allocate=False)  # fmt: skip
        return trainer, batch

    seen = []
    result = recommend(compile_trainer, 10**9, strategies=["tp", "pmap", "dp"],
                       progress=lambda i, n, name: seen.append((i, n, name)))  # fmt: skip
    rows = {r["strategy"]: r for r in result["strategies"]}
    assert rows["tp"]["error"].startswith("divides nothing here: the batch and every parameter")
    assert rows["pmap"]["sent_bytes"] == rows["dp"]["sent_bytes"]
    assert result["recommended"] == "dp" and result["reason"].endswith(
        "the plainest step of those sending as little (pmap)"
    )
    assert seen == [(0, 3, "tp"), (1, 3, "pmap"), (2, 3, "dp"), (3, 3, "")]


def test_a_tied_embedding_is_gradients_not_activations_and_dp_is_recommended():
    """An embedding tied to the output has a gradient of two parts (the lookup's and the
    logits' product); XLA's CPU compiler all-reduces each apart, 2 x the table under dp where
    pmap sends it once. The textbook counts the parts, so dp moves no activations, and bytes
    compare with the gradient reduced once: dp and pmap tie, and the plainer step wins."""
    from flax import nnx

    from shardplug.planning.recommend import recommend

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(256, 64, rngs=rngs)
            self.mid = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, tokens):
            return self.embed.attend(nnx.relu(self.mid(self.embed(tokens))))

    def loss_fn(model, batch):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    tokens = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 256
    batch = {"tokens": tokens, "targets": (tokens + 1) % 256}
    trainers = {}

    def compile_trainer(name):
        trainers[name] = shardplug.Trainer(shardplug.from_nnx(Tied), loss_fn=loss_fn,
                                           optimizer=optax.sgd(0.1), strategy=name,
                                           allocate=False)  # fmt: skip
        return trainers[name], batch

    result = recommend(compile_trainer, 10**9, strategies=["pmap", "dp"])
    rows = {r["strategy"]: r for r in result["strategies"]}
    table = 256 * 64 * 4
    # dp's compiled all-reduce holds the table twice, pmap's once
    assert rows["dp"]["sent_bytes"] - rows["pmap"]["sent_bytes"] == wire_bytes(
        "all-reduce", table, 8
    ) == rows["dp"]["parts_bytes"]  # fmt: skip
    assert rows["pmap"]["parts_bytes"] == 0
    loss = round(wire_bytes("all-reduce", 4, 8))  # the mean loss: all either sends besides
    assert rows["dp"]["activation_bytes"] == rows["pmap"]["activation_bytes"] == loss
    assert result["recommended"] == "dp", result["reason"]
    assert "moves parameters and gradients only" in result["reason"]
    assert "activations" not in result["reason"]
    report = explain(trainers["dp"], batch)
    assert report.textbook_bytes() == report.collective_bytes() - 4  # all but the loss
    (parts,) = report.gradient_parts
    assert parts["params"] == ["embed/embedding"] and parts["parts"] == 2
    assert any("embed/embedding (256x64) is all-reduced in 2 parts" in n for n in report.notes)


def test_recommend_follows_the_memory(capsys):
    assert main(["recommend", "--model", "mlp", "--device-memory", "80GB", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["recommended"] == "dp" and "parameters and gradients only" in roomy["reason"]
    import io

    from rich.console import Console

    from shardplug.planning.views import render_recommend

    console = Console(width=250, record=True, file=io.StringIO())
    render_recommend(roomy, console, "mlp")  # every ep composition refused: one row
    refused = [r for r in roomy["strategies"] if r.get("error", "").startswith("ep splits")]
    assert len(refused) > 10 and console.export_text().count("ep splits a mixture") == 1
    assert {"dp+fsdp", "fsdp+tp", "dp+fsdp+tp"} <= {r["strategy"] for r in roomy["strategies"]}
    peaks = {r["strategy"]: r["peak_bytes"] for r in roomy["strategies"] if "error" not in r}
    pipelined = {r["strategy"]: r["error"] for r in roomy["strategies"] if "pp" in r["strategy"]}
    assert pipelined and all("this model has none" in e for e in pipelined.values())
    assert peaks["fsdp"] < peaks["dp"]
    between = (peaks["fsdp"] + min(peaks["dp"], peaks["2d"])) // 2
    assert main(["recommend", "--model", "mlp", "--device-memory", str(between), "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["recommended"] == "fsdp" and "dp, pmap" in tight["reason"]
    assert main(["recommend", "--model", "mlp", "--device-memory", "1kB"]) == 0
    out, err = capsys.readouterr()
    assert "recommended: none" in out
    lines = err.splitlines()  # in a pipe: a line per candidate, then the time it took
    assert lines[0] == f"shardplug: compiling 1 of {len(roomy['strategies'])}: 2d"
    assert lines[-1].startswith("shardplug: compiled the candidates in ")


def test_bench_compares_with_hand_written_jax(tmp_path, capsys):
    png = tmp_path / "bench.png"
    assert main(["bench", "--strategies", "dp,pmap", "--model", "mlp", "--steps", "2",
                 "--rounds", "2", "--json", "--plot", str(png)]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    kinds = [r["kind"] for r in report["results"]]
    assert kinds == ["shardplug", "hand-written"] * 2 + ["nnx.jit", "one device"]
    assert set(report["ratios"]) == {"dp", "pmap"} and report["nnx_jit_ratio"] > 0
    assert max(report["max_loss_diff"].values()) < 1e-5  # the baseline did the same work
    for r in report["results"]:
        assert len(r["step_seconds"]) == 2 and r["samples_per_second"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_baseline_refuses_models_with_state():
    from shardplug.planning.bench import bench

    with pytest.raises(ConfigError, match="without model state; 'cnn' has batch statistics"):
        bench(["dp"], "cnn", steps=1, rounds=1)


def test_bench_needs_a_hand_written_twin(monkeypatch):
    from shardplug.planning.bench import bench
    from shardplug.strategies.pmap import PerDeviceProgram

    with pytest.raises(shardplug.UnknownStrategyError, match="unknown strategy 'mine'"):
        bench(["dp", "mine"], "mlp", steps=1, rounds=1)
    monkeypatch.delattr(PerDeviceProgram, "baseline")  # a whole strategy that names none
    with pytest.raises(ConfigError, match="pmap has no hand-written twin"):
        bench(["dp", "pmap"], "mlp", steps=1, rounds=1)


def test_explain_groups_parameters_that_share_a_layout_unless_all(capsys):
    from shardplug.planning.explain import ParamReport
    from shardplug.planning.views import groups

    def report(path, spec="P('fsdp')"):
        return ParamReport(path, (64, 64), "float32", spec, 2048, False, None)

    rows = groups([report("blocks/0/wq"), report("blocks/1/wq"), report("blocks/1/wo", "P()")])
    assert [(r["path"], r["count"], r["bytes_per_device"]) for r in rows] == [
        ("blocks/*/wq", 2, 4096),
        ("blocks/1/wo", 1, 2048),  # a group of one keeps its path
    ]
    assert main(["explain", "--model", "transformer", "--strategy", "fsdp", "--layers", "2"]) == 0
    grouped = capsys.readouterr().out  # a layer stack: one row per stacked parameter already
    assert "blocks/wq" in grouped and "groups" not in grouped
    assert main(["explain", "--model", "transformer", "--strategy", "fsdp", "--all"]) == 0
    every = capsys.readouterr().out
    assert "blocks/wq" in every and "groups" not in every


def test_explain_groups_the_numbered_blocks_of_a_linen_list_as_an_nnx_list():
    """Linen names a list's members ``blocks_0``, ``blocks_1``, ... (Griffin its own
    ``blocks.0``): they are grouped as an NNX list's ``blocks/0`` are; numbered siblings
    that differ (Linen's automatic ``Dense_0`` and ``Dense_1``) are not."""
    import flax.linen as linen
    from flax import nnx

    from shardplug.planning.explain import ParamReport
    from shardplug.planning.views import groups

    class LinenBlocks(linen.Module):
        def setup(self):
            self.blocks = [linen.Dense(16) for _ in range(4)]
            self.head = linen.Dense(4)

        def __call__(self, x):
            for block in self.blocks:
                x = linen.relu(block(x))
            return self.head(x)

    class NNXBlocks(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = nnx.relu(block(x))
            return self.head(x)

    batch = {"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 4), np.float32)}

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    adapters = {
        "blocks_": shardplug.from_linen(LinenBlocks(), batch["x"][:1]),
        "blocks/": shardplug.from_nnx(NNXBlocks),
    }
    for prefix, adapter in adapters.items():
        trainer = shardplug.Trainer(adapter, loss_fn=loss_fn, optimizer=optax.sgd(0.1),
                                    strategy="dp", allocate=False)  # fmt: skip
        rows = groups(explain(trainer, batch).params)
        assert sorted((r["path"], r["count"]) for r in rows) == [
            (f"{prefix}*/bias", 4), (f"{prefix}*/kernel", 4), ("head/bias", 1),
            ("head/kernel", 1),
        ]  # fmt: skip

    def report(path, shape):
        return ParamReport(path, shape, "float32", "P()", 4 * math.prod(shape), True, None)

    named = [("blocks.0/w", (8,)), ("blocks.1/w", (8,)), ("Dense_0/kernel", (16, 32)),
             ("Dense_1/kernel", (32, 4))]  # fmt: skip
    rows = groups([report(path, shape) for path, shape in named])
    assert [(r["path"], r["count"]) for r in rows] == [
        ("blocks.*/w", 2), ("Dense_0/kernel", 1), ("Dense_1/kernel", 1),
    ]  # fmt: skip


DEEP = """
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import shardplug


class Deep(nnx.Module):  # 150 layers, not stacked: 300 parameters
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(150)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def batches():  # a generator, read once
    rng = np.random.default_rng(0)
    while True:
        yield {"x": rng.normal(size=(8, 16)).astype("float32")}


task = shardplug.Task(
    adapter=shardplug.from_nnx(Deep),
    loss_fn=lambda model, batch: jnp.mean(model(batch["x"]) ** 2),
    optimizer=optax.adam(1e-3),
    data=batches(),
)
"""


def test_explain_prints_a_300_parameter_model_as_two_groups(tmp_path, capsys):
    (tmp_path / "deep.py").write_text(DEEP)
    assert main(["explain", "--task", f"{tmp_path / 'deep.py'}:task", "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    table = out.split("memory per device")[0]
    assert "300 in 2 groups" in table
    assert "layers/*/kernel" in table and "layers/*/bias" in table and "layers/7/" not in table


def test_the_longest_sequence_search_brackets_the_limit(monkeypatch):
    """recommend --longest-sequence's search, against a known peak: doubles from the task's
    length, then halves the gap until the longest fit and the first miss are within an
    eighth; one sample per batch-splitting device (the mesh's data axes)."""
    from types import SimpleNamespace

    import numpy as np
    from jax.sharding import PartitionSpec as P

    import shardplug.planning.longest as rec

    memory = 10**9
    meshes = {"fsdp": {"fsdp": 8}, "fsdp+cp": {"fsdp": 4, "context": 2}}
    specs = {"fsdp": P("fsdp"), "fsdp+cp": P("fsdp", "context")}

    def compile_at(name, sequence, rows):
        batch = {"tokens": np.zeros((rows or 8, sequence), np.int32)}
        sharding = SimpleNamespace(spec=specs[name])
        strategy = SimpleNamespace(shard_batch=lambda b, m: {"tokens": sharding})
        return SimpleNamespace(strategy=strategy, mesh=SimpleNamespace(shape=meshes[name])), batch

    def fake_explain(trainer, batch, device_memory):  # a row's tokens on a device, squared
        rows, length = batch["tokens"].shape
        context = trainer.mesh.shape.get("context", 1)
        tokens = length // context * rows // (8 // context)
        return SimpleNamespace(per_device={"peak_bytes": 2 * 10**8 + tokens**2})

    monkeypatch.setattr(rec, "explain", fake_explain)
    result = rec.longest_sequences(compile_at, memory, ["fsdp", "fsdp+cp"], 4096)
    rows = {r["strategy"]: r for r in result["strategies"]}
    limit = int((memory - 2 * 10**8) ** 0.5)  # 28,284 tokens on a device
    for name, per_device in (("fsdp", 1), ("fsdp+cp", 2)):
        row = rows[name]
        assert row["rows"] == meshes[name].get("fsdp")
        assert row["longest"] <= limit * per_device < row["first_over"]
        assert row["first_over"] - row["longest"] <= row["longest"] / 8
        assert row["peak_bytes"] <= memory < dict(row["tried"])[row["first_over"]]
    assert rows["fsdp+cp"]["longest"] > 1.7 * rows["fsdp"]["longest"]
    assert len(rows["fsdp"]["tried"]) <= 8  # 4k, 8k, 16k, 32k, then three halvings
    (high,) = rec.longest_sequences(compile_at, memory, ["fsdp"], 65536)["strategies"]
    assert high["longest"] <= limit < high["first_over"] and high["tried"][0][0] < 65536


def test_plot_paths_are_made_or_refused_before_the_work(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "layout"
    assert main(["explain", "--model", "mlp", "--plot", str(target)]) == 0
    assert f"shardplug: wrote {target}.png" in capsys.readouterr().out  # the path written
    assert (tmp_path / "no" / "such" / "layout.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "--strategies", "dp", "--model", "mlp", "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"shardplug: error: --plot {tmp_path} is a folder: name the .png file to write in it\n"
    )


def test_the_longest_sequence_says_its_cap_and_refuses_what_it_cannot_plan(capsys):
    from shardplug.planning.longest import longest_sequences

    model = shardplug.get_model("transformer")

    def compile_at(name, sequence, rows):
        task = model.task("nnx", sequence=sequence, batch_size=rows or 8)
        trainer = task.trainer(strategy=name, allocate=False, devices=2)
        return trainer, next(iter(task.batches()))

    result = longest_sequences(compile_at, 10**12, ["dp"], start=16, limit=32)
    (row,) = result["strategies"]
    assert row["longest"] == 32 and row["capped"]  # it still fit at the most tried
    for argv, message in [
        (["--model", "mlp", "--strategies", "dp,fsdp"],
         "--longest-sequence: every strategy was refused this model (2); dp: model 'mlp'"),
        (["--batch-size", "64"], "--batch-size 64: --longest-sequence plans one sample per"),
    ]:  # fmt: skip
        assert main(["recommend", "--longest-sequence", "--device-memory", "80GB", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()  # after what it compiled, if any
        said = [line for line in err if not line.startswith("shardplug: compil")]
        assert len(said) == 1 and message in said[0], err


LENDER = '''
from shardplug.plugin import RANK, Axis, hookimpl


class Lender:
    """Splits no parameter; lends its axis to store what is left whole."""

    @hookimpl
    def parallel_axis(self):
        return Axis("lent", rank=RANK["model"], lends=True)
'''


def test_an_axis_lent_for_storage_is_not_called_tensor_parallelism(tmp_path, monkeypatch):
    from shardplug.core import registry
    from tests.test_registry import install

    install(tmp_path, monkeypatch, "lender", "0.1", {"lent": "lender:Lender"}, {"lender": LENDER})
    try:
        model = shardplug.get_model("mlp")
        trainer = model.task("nnx").trainer(strategy="fsdp+lent", mesh="fsdp=4,lent=2",
                                            allocate=False)  # fmt: skip
        report = explain(trainer, next(model.batches(32)))
        stored = {a for p in report.params for a in str(p.spec).replace("'", " ").split()}
        assert "lent" in stored  # fsdp stores over the lent axis too...
        assert not any("tensor parallelism" in note for note in report.notes), report.notes
    finally:
        registry._discover.cache_clear()
