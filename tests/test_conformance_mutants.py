"""Every check of the conformance suite can fail: each meets a plugin broken in exactly the
way it exists to catch, installed as a third-party package would be, and fails it."""

import textwrap

import pytest
from test_registry import fresh_registry, install  # noqa: F401 (a fixture)

from shardplug.testing import StrategyConformance

MUTANTS = textwrap.dedent(
    '''
    import jax
    from jax.lax import with_sharding_constraint as constrain  # by name: core cannot adapt it
    from jax.sharding import PartitionSpec as P

    from shardplug.plugin import build_mesh, hookimpl, shard_largest_dim


    class Rows:
        """Data parallel over 'rows', written plainly: each mutant breaks one thing."""

        @hookimpl
        def make_mesh(self, devices, mesh_shape):
            return build_mesh(devices, mesh_shape, default={"rows": -1})

        @hookimpl
        def shard_params(self, params):
            return jax.tree.map(lambda _: P(), params)

        @hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda x: P("rows") if x.ndim else P(), batch)


    class Leading(Rows):
        """The earlier contract's whole strategy: every parameter's first dimension split
        over 'rows' where it divides, a layer stack's layer dimension included; no gather."""

        @hookimpl
        def shard_params(self, params, mesh):
            n = mesh.shape["rows"]
            return jax.tree.map(lambda x: P("rows") if x.ndim and x.shape[0] % n == 0 else P(),
                                params)  # fmt: skip


    class Ascends(Rows):
        """Its gradient reduction flips the sign: training diverges from one device's."""

        @hookimpl
        def reduce_grads(self, grads):
            return jax.tree.map(lambda g: -g, grads)


    class Duplicates(Rows):
        """Gives every device the whole batch, and does not say so."""

        @hookimpl
        def shard_batch(self, batch):
            return jax.tree.map(lambda _: P(), batch)


    class Uneven(Rows):
        """Splits the largest dimension whether or not the axis divides it."""

        @hookimpl
        def shard_params(self, params, mesh):
            def split(x):
                dim = max(range(x.ndim), key=lambda d: x.shape[d]) if x.ndim else None
                return P(*[("rows" if d == dim else None) for d in range(x.ndim)])

            return jax.tree.map(split, params)


    class DropsKinds(Rows):
        """Compiles its step with every state array in device memory: under offload it
        would bring the state to the devices and back every step."""

        @hookimpl
        def compile_step(self, step_fn, state_shardings, batch_shardings):
            kept = jax.tree.map(lambda s: s.with_memory_kind("device"), state_shardings)
            return jax.jit(step_fn, in_shardings=(kept, batch_shardings),
                           out_shardings=(kept, None), donate_argnums=0)  # fmt: skip


    class AutoOnly(Rows):
        """Stores parameters split and gathers them with with_sharding_constraint imported
        by name: on explicit axes that only asserts."""

        @hookimpl
        def shard_params(self, params, mesh):
            return jax.tree.map(lambda x: shard_largest_dim(x.shape, "rows", mesh, 256), params)

        @hookimpl
        def gather_params(self, params, mesh):
            return jax.tree.map(lambda p: constrain(p, P()), params)
    '''
)


@pytest.fixture
def mutants(tmp_path, monkeypatch, fresh_registry):  # noqa: F811
    names = {"ascends": "Ascends", "duplicates": "Duplicates", "uneven": "Uneven", "rows": "Rows",
             "auto-only": "AutoOnly", "leading": "Leading",
             "drops-kinds": "DropsKinds"}  # fmt: skip
    entry_points = {name: f"mutants:{cls}" for name, cls in names.items()}
    install(tmp_path, monkeypatch, "mutants", "0.1", entry_points, {"mutants": MUTANTS})


def suite(name: str) -> StrategyConformance:
    return type("Suite", (StrategyConformance,), {"strategy": name})()


def test_the_plain_plugin_passes_every_check(mutants):
    rows = suite("rows")
    rows.test_trains_like_one_device("nnx", "mlp")
    rows.test_batch_is_split_not_duplicated()
    rows.test_uneven_shapes_still_train()
    rows.test_trains_like_one_device_on_explicit_axes()
    rows.test_keeps_the_state_where_offload_places_it()
    suite("auto-only").test_trains_like_one_device("nnx", "mlp")  # on auto axes it is right


def test_a_plugin_of_the_earlier_contract_splitting_a_layer_stack_passes_every_check(mutants):
    """Written before explicit axes existed, it splits the layer stack's layer dimension;
    on explicit axes core moves that split off the dimension the stack's loop runs over and
    gathers one layer at a time, as the compiler does on auto axes (JAX refused the scan:
    "0th dimension of all xs should be replicated")."""
    leading = suite("leading")
    leading.test_trains_like_one_device("nnx", "transformer")
    leading.test_trains_like_one_device("equinox", "transformer")
    leading.test_batch_is_split_not_duplicated()
    leading.test_uneven_shapes_still_train()
    leading.test_trains_like_one_device_on_explicit_axes()


def test_a_wrong_gradient_fails_trains_like_one_device(mutants):
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        suite("ascends").test_trains_like_one_device("nnx", "mlp")


def test_a_duplicated_batch_fails_batch_is_split(mutants):
    with pytest.raises(AssertionError, match="every device holds the whole batch"):
        suite("duplicates").test_batch_is_split_not_duplicated()


def test_splitting_what_does_not_divide_fails_uneven_shapes(mutants):
    """Core refuses the layout in one line naming the plugin and the parameter (JAX's
    IndivisibleError, a traceback from deep inside device_put, before)."""
    import shardplug

    with pytest.raises(shardplug.PluginError, match=r"strategy 'uneven': shard_params splits"):
        suite("uneven").test_uneven_shapes_still_train()


def test_a_hook_that_only_works_on_auto_axes_fails_explicit_axes(mutants):
    import shardplug

    with pytest.raises(shardplug.PluginError, match=r"acts as an assert.*lay_out"):
        suite("auto-only").test_trains_like_one_device_on_explicit_axes()


def test_a_step_program_that_drops_memory_kinds_fails_offload(mutants):
    """It trains like one device without offload; with it, core refuses its program in one
    line, which the conformance check surfaces."""
    import shardplug

    suite("drops-kinds").test_trains_like_one_device("nnx", "mlp")
    with pytest.raises(
        shardplug.PluginError,
        match="compile_step's program takes the state's "
        r"opt_state/\S+ in memory 'device'",
    ):
        suite("drops-kinds").test_keeps_the_state_where_offload_places_it()
