"""The third-party context parallelism passes shardplug's conformance suite, composes with the
built-ins by name, and explains its gathers."""

import json
import subprocess
import sys

from jax.sharding import PartitionSpec as P

import shardplug
from shardplug.core.compiled.hlo import collectives
from shardplug.planning.explain import explain
from shardplug.testing import StrategyConformance


class TestGatherContext(StrategyConformance):
    strategy = "fsdp+cp-gather"
    mesh = "fsdp=2,seq=4"


def _trainer(strategy="dp+cp-gather", mesh="data=2,seq=4"):
    model = shardplug.get_model("transformer")
    return model, model.task("nnx").trainer(strategy=strategy, mesh=mesh, allocate=False)


def test_its_attention_gathers_keys_and_values_and_explain_says_so():
    """The compiled step all-gathers (keys and values, each layer) and sends nothing round a
    ring; explain shows the sequence's split and the gathers' bytes in its own words."""
    model, trainer = _trainer()
    report = explain(trainer, next(model.batches(model.batch_size, 0)))
    found = {c.kind for c in collectives(trainer.compiled.as_text())}
    assert "all-gather" in found and "collective-permute" not in found
    assert trainer.batch_shardings["tokens"].spec == P("data", "seq")
    mine = report.parallelisms["cp-gather"]
    assert (mine["length"], mine["per_device"], mine["devices"]) == (32, 8, 4)
    assert mine["all_gather_bytes"] > 0
    assert any(n.startswith("cp-gather: each device holds 8 of the 32") for n in report.notes)


def test_listed_as_a_parallelism_of_its_package():
    listing = subprocess.run(
        [sys.executable, "-m", "shardplug", "strategies", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    rows = {r["name"]: r for r in json.loads(listing.stdout)}
    assert rows["cp-gather"]["source"] == "shardplug-cp-gather 0.1.0"
    assert rows["cp-gather"]["kind"] == "parallelism"
