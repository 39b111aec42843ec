"""Strategies are found by name through entry points; bad names and options fail clearly."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import shardplug
from shardplug.core import registry


def test_builtins_are_listed_with_their_own_descriptions():
    infos = {i.name: i for i in shardplug.list_strategies()}
    assert {"dp", "fsdp", "tp", "2d", "pmap"} <= infos.keys()
    for name in ("dp", "fsdp", "2d", "pmap"):
        assert infos[name].source == "built-in"
        assert infos[name].description == infos[name].description.strip()
        assert infos[name].description != "(no description)"
    assert infos["fsdp"].description.startswith("Fully sharded data parallel")
    assert [o.name for o in infos["fsdp"].options] == ["min_size", "prefer"]


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(shardplug.UnknownStrategyError) as info:
        shardplug.get_strategy("zero3")
    assert "'zero3'" in str(info.value)
    assert "2d, cp, dp, ep, fsdp, pmap, pp, tp" in str(info.value)
    assert isinstance(info.value, shardplug.ShardplugError)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("fsdp", {"threshold": 3}, "has no option 'threshold'; its options: min_size"),
        ("fsdp", {"min_size": -1}, "min_size must be a non-negative integer"),
        ("dp", {"min_size": 0}, "has no option 'min_size'; its options: none"),
        ("2d", {"rules": {"mlp": "data"}}, "may only map onto 'model'"),
    ],
)
def test_bad_options_raise_typed_errors(name, options, message):
    with pytest.raises(shardplug.StrategyOptionError, match=message):
        shardplug.get_strategy(name, **options)


def test_each_strategy_gets_its_own_configured_instance():
    a = shardplug.get_strategy("fsdp", min_size=0)
    b = shardplug.get_strategy("fsdp")
    assert (a.parts["fsdp"].min_size, b.parts["fsdp"].min_size) == (0, 1024)
    both = shardplug.get_strategy("fsdp+tp", min_size=0, **{"tp.min_size": 7})
    assert (both.parts["fsdp"].min_size, both.parts["tp"].min_size) == (0, 7)


PLUGIN = textwrap.dedent(
    '''
    """A third-party strategy that implements only three hooks."""
    import jax
    from jax.sharding import PartitionSpec as P

    import shardplug
    from shardplug.core.mesh import build_mesh


    class Rows:
        """Rows: everything replicated, batch rows over a 'rows' axis."""

        @shardplug.hookimpl
        def make_mesh(self, devices, mesh_shape):
            return build_mesh(devices, mesh_shape, default={"rows": -1})

        @shardplug.hookimpl
        def shard_params(self, params):
            return jax.tree.map(lambda _: P(), params)

        @shardplug.hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda _: P("rows"), batch)
    '''
)


def install(tmp_path, monkeypatch, dist, version, entry_points, modules, group="shardplug"):
    """A real installed distribution: a dist-info folder and modules on sys.path."""
    info = tmp_path / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    for module, source in modules.items():
        (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SHARDPLUG_PLUGINS", ",".join(entry_points))
    registry._discover.cache_clear()


@pytest.fixture
def fresh_registry():
    registry._discover.cache_clear()
    yield
    registry._discover.cache_clear()


def test_third_party_plugin_is_found_and_trains_like_dp(tmp_path, monkeypatch, fresh_registry):
    install(
        tmp_path, monkeypatch, "rowsplug", "1.2", {"rows": "rowsplug:Rows"}, {"rowsplug": PLUGIN}
    )
    infos = {i.name: i for i in shardplug.list_strategies()}
    assert infos["rows"].source == "rowsplug 1.2"
    assert (
        infos["rows"].description == "Rows: everything replicated, batch rows over a 'rows' axis."
    )
    assert [i.name for i in shardplug.list_strategies()][-1] == "rows"  # after the built-ins

    model = shardplug.get_model("mlp")
    losses = {}
    for name in ("rows", "dp"):
        trainer = shardplug.Trainer(
            model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(3e-3), strategy=name
        )
        losses[name] = [r["loss"] for r in trainer.fit(model.batches(64, 0), steps=5)]
        assert trainer.mesh.axis_names == (("rows",) if name == "rows" else ("data",))
    np.testing.assert_allclose(losses["rows"], losses["dp"], rtol=1e-6)


def test_broken_plugin_is_named_and_the_others_keep_working(tmp_path, monkeypatch, fresh_registry):
    install(
        tmp_path,
        monkeypatch,
        "brokenplug",
        "0.3",
        {"broken": "brokenplug:Broken"},
        {"brokenplug": "raise ImportError('needs a library that is not installed')\n"},
    )
    with pytest.warns(
        shardplug.ShardplugWarning,
        match=r"plugin 'broken' \(brokenplug 0.3\) "
        "cannot be used: import failed: ImportError: needs a library",
    ):
        names = {i.name for i in shardplug.list_strategies()}
    assert {"dp", "fsdp", "tp", "2d", "pmap"} <= names and "broken" not in names
    everything = {i.name: i for i in shardplug.list_strategies(include_broken=True)}
    assert everything["broken"].error.startswith("import failed: ImportError")
    with pytest.raises(
        shardplug.PluginError,
        match=r"strategy 'broken' \(brokenplug 0.3\) cannot be used: import failed",
    ):
        shardplug.get_strategy("broken")


def test_two_packages_claiming_one_name_are_refused_naming_both(
    tmp_path, monkeypatch, fresh_registry
):
    install(tmp_path, monkeypatch, "rowsplug", "1.2", {"dp": "rowsplug:Rows"}, {"rowsplug": PLUGIN})
    with (
        pytest.warns(shardplug.ShardplugWarning),
        pytest.raises(shardplug.PluginError, match="claimed by two packages") as info,
    ):
        shardplug.get_strategy("dp")
    assert "rowsplug 1.2" in str(info.value) and "shardplug 0.1.0" in str(info.value)
    assert "uninstall one of them" in str(info.value)


def test_hook_implementation_with_a_wrong_signature_is_refused():
    class Wrong:
        @shardplug.hookimpl
        def shard_params(self, params, mesh, annotations, extra):
            return None

    info = registry.StrategyInfo("wrong", "wrong", "tests", "0")
    with pytest.raises(shardplug.PluginError, match="'wrong' does not fit the hook specs"):
        registry.Strategy(info, Wrong())


def test_unknown_hook_is_refused():
    class Typo:
        @shardplug.hookimpl
        def shard_param(self, params):
            return None

    info = registry.StrategyInfo("typo", "typo", "tests", "0")
    with pytest.raises(shardplug.PluginError, match="shard_param"):
        registry.Strategy(info, Typo())


def test_failing_hook_names_the_strategy_and_the_hook():
    class Failing:
        @shardplug.hookimpl
        def shard_batch(self, batch):
            raise RuntimeError("boom")

    strategy = registry.Strategy(registry.StrategyInfo("failing", "f", "tests", "0"), Failing())
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1), strategy=strategy
    )
    with pytest.raises(
        shardplug.PluginError,
        match="strategy 'failing': hook shard_batch failed: RuntimeError: boom",
    ):
        trainer.fit(model.batches(64, 0), steps=1)


def test_spec_naming_a_missing_mesh_axis_is_reported_with_the_parameter():
    class BadAxis:
        @shardplug.hookimpl
        def shard_params(self, params):
            import jax
            from jax.sharding import PartitionSpec as P

            return jax.tree.map(lambda _: P("model"), params)

    strategy = registry.Strategy(registry.StrategyInfo("badaxis", "b", "tests", "0"), BadAxis())
    model = shardplug.get_model("mlp")
    with pytest.raises(
        shardplug.PluginError,
        match=r"shard_params gave fc1/bias .* naming axes "
        r"\['model'\]",
    ):
        shardplug.Trainer(
            model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1), strategy=strategy
        )


MISFIT = textwrap.dedent(
    """
    import shardplug

    class Misfit:
        \"\"\"Implements a hook with an argument the spec does not have.\"\"\"

        @shardplug.hookimpl
        def shard_params(self, params, mesh, annotations, extra):
            return None

    class Typo:
        \"\"\"Implements a hook that does not exist.\"\"\"

        @shardplug.hookimpl
        def shard_param(self, params):
            return None
    """
)


def test_hooks_that_misfit_the_specs_are_reported_at_load(tmp_path, monkeypatch, fresh_registry):
    install(
        tmp_path,
        monkeypatch,
        "misfits",
        "1.0",
        {"misfit": "misfits:Misfit", "typo": "misfits:Typo"},
        {"misfits": MISFIT},
    )
    with pytest.warns(shardplug.ShardplugWarning):
        infos = {i.name: i for i in shardplug.list_strategies(include_broken=True)}
    assert "hooks do not fit the specs" in infos["misfit"].error
    assert "extra" in infos["misfit"].error
    assert "shard_param" in infos["typo"].error
    assert infos["dp"].error is None
    with pytest.raises(shardplug.PluginError, match=r"'typo' .* cannot be used: hooks do not fit"):
        shardplug.get_strategy("typo")


def test_hooks_implemented_are_recorded():
    infos = {i.name: i for i in shardplug.list_strategies()}
    assert infos["pmap"].hooks == (
        "compile_step",
        "make_mesh",
        "reduce_grads",
        "shard_batch",
        "shard_params",
    )
    assert infos["dp"].hooks == ("parallel_axis",)
    assert infos["fsdp"].hooks == ("gather_param", "parallel_axis", "split_param")
    assert (infos["dp"].kind, infos["pmap"].kind, infos["2d"].kind) == (
        "parallelism",
        "strategy",
        "composition",
    )


def test_shardplug_plugins_narrows_what_loads(tmp_path, monkeypatch, fresh_registry):
    install(
        tmp_path, monkeypatch, "rowsplug", "1.2", {"rows": "rowsplug:Rows"}, {"rowsplug": PLUGIN}
    )
    monkeypatch.setenv("SHARDPLUG_PLUGINS", "")
    builtins = {"dp", "fsdp", "tp", "pp", "cp", "ep", "2d", "pmap"}
    assert {i.name for i in shardplug.list_strategies()} == builtins
    monkeypatch.setenv("SHARDPLUG_PLUGINS", "rows")
    assert "rows" in {i.name for i in shardplug.list_strategies()}
    monkeypatch.setenv("SHARDPLUG_PLUGINS", "something-else")
    with pytest.raises(shardplug.UnknownStrategyError):
        shardplug.get_strategy("rows")


ADDON = textwrap.dedent(
    """
    import jax
    from jax.sharding import PartitionSpec as P

    import shardplug


    class ReplicateAll:
        \"\"\"Replicate every parameter, whatever the strategy chose.\"\"\"

        @shardplug.hookimpl(wrapper=True)
        def shard_params(self, params):
            chosen = yield
            return jax.tree.map(lambda _: P(), chosen, is_leaf=lambda x: isinstance(x, P))
    """
)


def test_addon_wraps_any_strategy(tmp_path, monkeypatch, fresh_registry):
    install(
        tmp_path,
        monkeypatch,
        "replicate",
        "0.1",
        {"replicate-all": "replicate:ReplicateAll"},
        {"replicate": ADDON},
        group="shardplug.addons",
    )
    assert [a.name for a in shardplug.list_addons()] == ["float8", "grad-bf16", "offload",
                                                          "replicate-all"]  # fmt: skip
    model = shardplug.get_model("mlp")
    strategy = shardplug.get_strategy("fsdp", addons=["replicate-all"], min_size=0)
    assert strategy.addons == ("replicate-all",)
    trainer = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(3e-3), strategy=strategy
    )
    assert all(s.is_fully_replicated for s in jax.tree.leaves(trainer.param_shardings))
    plain = shardplug.Trainer(
        model.adapter("nnx"), loss_fn=model.loss_fn, optimizer=optax.adam(3e-3), strategy="fsdp"
    )
    assert not all(s.is_fully_replicated for s in jax.tree.leaves(plain.param_shardings))
    wrapped = [r["loss"] for r in trainer.fit(model.batches(64, 0), steps=4)]
    unwrapped = [r["loss"] for r in plain.fit(model.batches(64, 0), steps=4)]
    np.testing.assert_allclose(wrapped, unwrapped, rtol=1e-5)


def test_unknown_addon_lists_the_available_ones():
    with pytest.raises(shardplug.UnknownStrategyError, match="unknown add-on 'grad-fp8'"):
        shardplug.get_strategy("dp", addons=["grad-fp8"])


def test_broken_plugin_on_the_command_line(tmp_path):
    """A real process with a broken plugin installed: the listing still works and names it;
    selecting it is one line and exit code 2."""
    info = tmp_path / "brokenplug-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[shardplug]\nbroken = brokenplug:Broken\n")
    (tmp_path / "brokenplug.py").write_text("raise ImportError('needs a missing library')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SHARDPLUG_PLUGINS": "broken"}

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "shardplug", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    listing = run("strategies", "--json")
    assert listing.returncode == 0
    assert {"dp", "fsdp", "tp", "2d", "pmap"} <= {r["name"] for r in json.loads(listing.stdout)}
    assert listing.stderr.strip() == (
        "shardplug: warning: shardplug plugin 'broken' (brokenplug 0.3) cannot be used: "
        "import failed: ImportError: needs a missing library"
    )
    everything = json.loads(run("strategies", "--json", "--all").stdout)
    assert [r["error"] for r in everything if r["name"] == "broken"] == [
        "import failed: ImportError: needs a missing library"
    ]
    selected = run("train", "--strategy", "broken", "--quiet")
    assert selected.returncode == 2
    assert "Traceback" not in selected.stderr
    assert selected.stderr.strip().splitlines()[-1] == (
        "shardplug: error: strategy 'broken' (brokenplug 0.3) cannot be used: "
        "import failed: ImportError: needs a missing library"
    )


def test_a_mistyped_declared_field_is_a_load_error_naming_it(tmp_path, monkeypatch, fresh_registry):
    """A plugin declares description, unsupported and baseline, and only those; a capability
    nobody checks for (a typo) would silently skip nothing, so it is refused at load."""
    source = (
        PLUGIN
        + """

class Typo(Rows):
    unsupported = {"batch_split": "a typo of batch-split"}
"""
    )
    install(
        tmp_path, monkeypatch, "typoplug", "0.1", {"typo": "typoplug:Typo"}, {"typoplug": source}
    )  # a module of its own: rowsplug may be imported already
    with pytest.warns(shardplug.ShardplugWarning, match="'typo' .* cannot be used: plugin Typo"):
        infos = {i.name: i for i in shardplug.list_strategies(include_broken=True)}
    assert infos["typo"].error.startswith("plugin Typo: unsupported names 'batch_split', which")


def test_a_run_has_one_plugin_manager_holding_each_plugin_once(monkeypatch):
    import pluggy

    shardplug.list_strategies(), shardplug.list_addons()  # discovery (cached) checks each alone
    made = []
    original = pluggy.PluginManager.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(pluggy.PluginManager, "__init__", counting)
    strategy = shardplug.get_strategy("dp+fsdp+tp", addons=["grad-bf16"])
    model = shardplug.get_model("mlp")
    trainer = shardplug.Trainer(
        model.adapter(), loss_fn=model.loss_fn, optimizer=optax.sgd(0.1), strategy=strategy
    )
    trainer.fit(model.batches(64, 0), steps=1)
    assert made == [strategy.pm]
    names = [strategy.pm.get_name(p) for p in strategy.pm.get_plugins()]
    assert sorted(names) == sorted(
        ["shardplug.core.fallbacks", "dp", "fsdp", "tp", "dp+fsdp+tp (composition)", "grad-bf16"]
    )


RAISING = textwrap.dedent(
    '''
    import jax
    from shardplug.plugin import RANK, Axis, Operations, hookimpl, warn_once

    def attend(query, key, value, *, causal, bias, mask, scale):
        warn_once("raising attends once")
        return jax.shard_map(lambda q: q, in_specs=jax.P(jax.P.UNCONSTRAINED),
                             out_specs=jax.P())(query)

    class Raising:
        """Attention that fails inside JAX, as a plugin's own code does."""

        @hookimpl
        def parallel_axis(self):
            return Axis("heads", rank=RANK["model"] + 1)

        @hookimpl
        def operations(self, axis):
            return Operations(attention=attend)
    '''
)


def test_an_error_in_a_plugins_own_code_names_its_package_and_keeps_the_cause(
    tmp_path, monkeypatch, fresh_registry, capsys
):
    install(tmp_path, monkeypatch, "raising-plug", "0.2", {"raising": "raisingplug:Raising"},
            {"raisingplug": RAISING})  # fmt: skip
    from shardplug.cli import main
    from shardplug.errors import one_line, unsay

    assert main(["explain", "--strategy", "dp+raising", "--mesh", "data=4,heads=2"]) == 1
    err = capsys.readouterr().err  # (a refused program's warnings are dropped with it)
    assert err.count("\n") == 1, err
    assert "the plugin raising (package raising-plug) raised ValueError: shard_map" in err
    assert "in_specs refers to UNCONSTRAINED" in err  # JAX's cause, from its later lines
    assert "raisingplug.py:7 in attend" in err
    unsay(["raising attends once"])
    plugin = __import__("raisingplug")
    warned = pytest.warns(shardplug.plugin.ShardplugWarning, match="raising attends")
    with warned as said, pytest.raises(ValueError, match="context mesh") as raised:
        plugin.attend(np.ones((2, 4, 1, 1)), None, None, causal=False, bias=None, mask=None,
                      scale=None)  # fmt: skip
    assert said[0].filename == str(tmp_path / "raisingplug.py")  # its own line, not core's
    noted = f"{raised.value}\n{'-' * 20}\nFor simplicity, JAX has removed its internal frames"
    assert one_line(ValueError(noted)) == (  # JAX's note on its frames is no cause: dropped
        "The context mesh cannot be empty. Use `jax.set_mesh(mesh)` to enter into a mesh context"
    )


BAD_HOOK = '''
import shardplug


class BadHook:
    """A whole strategy whose mesh fails in two lines, as JAX's errors do."""

    @shardplug.hookimpl
    def make_mesh(self, devices, mesh_shape):
        raise ValueError("no mesh here:\\n\\n  the cause, on a line of its own")
'''


def test_a_hook_that_fails_is_one_line_naming_the_strategy_with_the_cause(
    tmp_path, monkeypatch, fresh_registry
):
    install(tmp_path, monkeypatch, "badhook", "0.1", {"badhook": "badhook:BadHook"},
            {"badhook": BAD_HOOK})  # fmt: skip
    model = shardplug.get_model("mlp")
    with pytest.raises(shardplug.errors.PluginError) as raised:
        model.task("nnx").trainer(strategy="badhook")
    assert str(raised.value) == (
        "strategy 'badhook': hook make_mesh failed: ValueError: no mesh here: the cause, on a "
        "line of its own"
    )
