"""What the published contract promises a plugin written outside shardplug: add-ons wrap a
composition's hooks, an operation comes from one parallelism at most, a plugin may declare
capabilities of its own, and the order of the axes is the ranks'."""

import textwrap

import pytest
from test_registry import fresh_registry, install  # noqa: F401 (a fixture)

import shardplug
from shardplug.testing import StrategyConformance

PLUGINS = textwrap.dedent(
    '''
    import jax

    from shardplug.plugin import RANK, Axis, Operations, hookimpl

    CALLS = []


    class Counting:
        """An add-on that counts the gather_params calls it wraps."""

        @hookimpl(wrapper=True)
        def gather_params(self, params):
            CALLS.append(len(jax.tree.leaves(params)))
            return (yield)


    class Attends:
        """A parallelism that supplies attention too."""

        @hookimpl
        def parallel_axis(self):
            return Axis("other", rank=RANK["context"] + 1)

        @hookimpl
        def operations(self):
            def attend(query, key, value, *, causal, bias, mask, scale):
                return jax.nn.dot_product_attention(query, key, value, is_causal=causal)

            return Operations(attention=attend)


    class Windowed:
        """Rows over 'win', and a capability of its own it lacks."""

        capabilities = {"sliding-window": "models whose attention has a sliding window"}
        unsupported = {"sliding-window": "it attends over the whole sequence"}

        @hookimpl
        def parallel_axis(self):
            return Axis("win", rank=RANK["data"] + 1, batch=True)
    '''
)


@pytest.fixture
def plugins(tmp_path, monkeypatch, fresh_registry):  # noqa: F811
    install(tmp_path, monkeypatch, "contract", "0.1",
            {"attends": "contract:Attends", "windowed": "contract:Windowed"},
            {"contract": PLUGINS})  # fmt: skip
    install(tmp_path, monkeypatch, "contract_addon", "0.1", {"counting": "contract:Counting"},
            {}, group="shardplug.addons")  # fmt: skip
    monkeypatch.setenv("SHARDPLUG_PLUGINS", "attends,windowed,counting")
    import contract

    return contract


def _compiled(strategy, **options):
    model = shardplug.get_model("transformer")
    trainer = model.task("nnx").trainer(
        strategy=shardplug.get_strategy(strategy, **options), allocate=False
    )
    trainer.compile(next(model.batches(model.batch_size, 0)))
    return trainer


def test_an_add_on_wraps_a_compositions_gather_params(plugins):
    """The step reaches the parameters through the gather_params hook under a composition
    too, so an add-on's wrapper runs (compositions went around it)."""
    _compiled("fsdp+tp", addons=["counting"])
    assert plugins.CALLS and plugins.CALLS[0] > 0


def test_two_parallelisms_supplying_one_operation_are_refused(plugins):
    with pytest.raises(shardplug.CompositionError, match="'cp' and 'attends' both supply "
                       "attention: a composition takes each operation from one"):  # fmt: skip
        _compiled("cp+attends")


def test_a_capability_of_its_own(plugins):
    strategy = shardplug.get_strategy("dp+windowed")
    assert strategy.capabilities == {
        "sliding-window": "models whose attention has a sliding window"
    }
    assert strategy.unsupported["sliding-window"] == "it attends over the whole sequence"
    suite = type("Suite", (StrategyConformance,), {"strategy": "dp+windowed"})()
    with pytest.raises(pytest.skip.Exception, match="does not support sliding-window: it attends"):
        suite.requires("sliding-window")
    with pytest.raises(ValueError, match="'sliding-windows' is not a capability"):
        suite.requires("sliding-windows")


def test_explain_states_the_order_the_ranks_give():
    """fsdp+cp+tp: the mesh fsdp, context, model (outermost first), claims the reverse."""
    from shardplug.planning.explain import explain

    model = shardplug.get_model("transformer")
    trainer = model.task("nnx").trainer(strategy="fsdp+cp+tp", allocate=False)
    report = explain(trainer, next(model.batches(model.batch_size, 0)))
    assert report.order == {
        "mesh": ["fsdp", "context", "model"],
        "claims": ["model", "context", "fsdp"],
    }
