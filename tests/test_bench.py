"""shardplug compiles the program its hand-written twin compiles: the overhead can only be on
the host (benchmarks/host_cost.py measures that)."""

import collections
import re

import pytest
from helpers import reference_trainer

import shardplug
from shardplug.core.compiled.hlo import collectives
from shardplug.planning.bench import hand_written

_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\(")

# What the trainer's step does beyond the twin's, and why it must stay: it counts its steps
# (one s32 add, the data position and each step's key, jax.random.fold_in(rng, step)) and
# passes the run's key through (one u32[2] parameter, no computation).
STEP_COUNTER_AND_KEY = collections.Counter(
    {
        ("parameter", "s32[]"): 3,  # the count, into the program and into its fusion
        ("constant", "s32[]"): 1,
        ("add", "s32[]"): 1,
        ("fusion", "s32[]"): 1,
        ("parameter", "u32[2]"): 1,
    }
)


def operations(hlo: str) -> collections.Counter:
    """Every instruction of the optimised module (fused computations included) as
    (opcode, result type), names, layouts and metadata aside; tuples left out (the
    trainer's carries the count and the key)."""
    found: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        match = _OP.match(re.sub(r",?\s*metadata=\{[^}]*\}", "", line))
        if match and match.group(2) != "tuple":
            found[match.group(2), re.sub(r"\{[^}]*\}", "", match.group(1))] += 1
    return found


@pytest.mark.parametrize(
    ("strategy", "model_name"),
    [
        ("dp", "mlp"),
        ("fsdp", "mlp"),
        ("2d", "mlp"),
        ("pmap", "mlp"),
        ("dp+fsdp", "mlp"),
        ("fsdp+tp", "mlp"),
        ("dp+fsdp+tp", "mlp"),
        ("fsdp+tp", "transformer"),
        ("fsdp+cp+tp", "transformer"),  # the twin's attention: the same ring
        ("pp+dp", "transformer"),  # the twin's layer stack: the same schedule
    ],
)
def test_the_compiled_step_is_the_hand_written_program(strategy, model_name):
    if strategy.startswith("pp"):  # the twin runs the stack operation's schedule: GPipe's
        strategy = shardplug.get_strategy(strategy, schedule="gpipe")
    model, trainer = reference_trainer(model_name, strategy)
    batch = next(model.batches(model.batch_size, 0))
    trainer.compile(batch)
    mine, twin = trainer.compiled.as_text(), hand_written(trainer, model, batch).as_text()
    extra, missing = operations(mine) - operations(twin), operations(twin) - operations(mine)
    assert not missing, f"the twin does what shardplug does not: {dict(missing)}"
    assert extra == STEP_COUNTER_AND_KEY, f"shardplug does more: {dict(extra)}"
    assert collectives(mine) == collectives(twin)


def test_benchs_default_strategies_are_found_by_what_their_plugins_declare(monkeypatch):
    """No name list: every installed strategy with a hand-written twin that runs any model
    with its batch split; tp (the batch replicated), pp, cp and ep (a stack, a sequence,
    experts needed) are left, a third-party strategy without a twin too."""
    from shardplug.planning.bench import default_strategies

    found = default_strategies()
    assert found[:4] == ["dp", "fsdp", "2d", "pmap"], found
    assert not {"tp", "pp", "cp", "ep", "hsdp", "cp-gather"} & set(found)
