"""The pytest plugin: matrix fixtures with readable ids, narrowing, and no JAX at import."""

import subprocess
import sys
import textwrap

import pytest

MATRIX_TEST = textwrap.dedent(
    """
    def test_cell(shardplug_strategy, shardplug_adapter, shardplug_model):
        assert isinstance(shardplug_strategy, str)


    def test_devices():
        import jax

        assert jax.device_count() == {devices}
    """
)


def collect(tmp_path, *args, env=None, devices=8):
    (tmp_path / "test_matrix.py").write_text(MATRIX_TEST.format(devices=devices))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    return done


def ids(output):
    return [line.split("[", 1)[1].rstrip("]") for line in output.splitlines() if "[" in line]


def test_fixtures_run_as_a_matrix_with_readable_ids(tmp_path):
    done = collect(tmp_path, "--collect-only")
    cells = ids(done.stdout)
    assert "fsdp-linen-transformer" in cells
    assert len(cells) == 8 * 3 * 4
    assert {c.split("-")[0] for c in cells} == {"2d", "cp", "dp", "ep", "fsdp", "pmap", "pp", "tp"}


def test_options_narrow_the_matrix(tmp_path):
    done = collect(
        tmp_path,
        "--collect-only",
        "--shardplug-strategies=dp,fsdp",
        "--shardplug-adapters=equinox",
        "--shardplug-models=cnn",
    )
    assert sorted(ids(done.stdout)) == ["dp-equinox-cnn", "fsdp-equinox-cnn"]


def test_environment_narrows_the_matrix(tmp_path):
    import os

    env = {**os.environ, "SHARDPLUG_STRATEGIES": "pmap", "SHARDPLUG_MODELS": "mlp"}
    done = collect(tmp_path, "--collect-only", env=env)
    assert sorted(ids(done.stdout)) == ["pmap-equinox-mlp", "pmap-linen-mlp", "pmap-nnx-mlp"]


def test_unknown_names_are_a_usage_error(tmp_path):
    done = collect(tmp_path, "--collect-only", "--shardplug-strategies=zero3")
    assert done.returncode == 4
    listed = "--shardplug-strategies: unknown zero3; available: 2d, cp, dp, ep, fsdp, pmap, pp"
    assert listed in done.stderr


@pytest.mark.parametrize("devices", [8, 3])
def test_simulated_devices_are_set_before_jax_starts(tmp_path, devices):
    done = collect(tmp_path, "-k", "devices", f"--shardplug-devices={devices}", devices=devices)
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_the_plugin_imports_no_jax():
    code = (
        "import sys, shardplug, shardplug.testing, shardplug.testing.pytest_plugin; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
