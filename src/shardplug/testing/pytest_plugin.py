"""The pytest plugin: strategy x adapter x model matrices on simulated devices.

Loaded through the ``pytest11`` entry point. It must not import JAX: it sets the number of
simulated CPU devices, which JAX reads when it starts.

- ``shardplug_strategy``, ``shardplug_adapter``, ``shardplug_model``: fixtures whose values are
  names, each parametrized over what is installed and registered, so a test that takes them
  runs as a matrix with ids such as ``[fsdp-linen-transformer]``; ``shardplug_schedule``:
  pp's schedules by name (``gpipe``, the built-ins, and those registered under
  ``shardplug.schedules``);
- ``--shardplug-strategies=dp,fsdp`` (and ``-adapters``, ``-models``, ``-schedules``), or the
  environment variables ``SHARDPLUG_STRATEGIES`` (...), narrow the matrix;
- ``--shardplug-devices=N`` or ``SHARDPLUG_DEVICES`` (default 8) simulated CPU devices.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys

import pytest

#: the adapters and reference models shardplug ships (tests check these match the code)
ADAPTERS = ("nnx", "linen", "equinox")
MODELS = ("mlp", "classifier", "transformer", "cnn")
KINDS = ("strategies", "adapters", "models", "schedules")
DEFAULT_DEVICES = 8


def compile_fast() -> None:
    """Compile as a test session that checks numbers, not speed, may: XLA's CPU backend skips
    its LLVM optimisations (compiling, most of a strategy suite's time, halves), and compiled
    programs are kept in JAX's persistent cache in the system's temporary folder, shared by
    pytest-xdist's workers and by the commands the tests start (a kept one loads in a quarter
    of its compile time). Call it in a ``conftest.py``, before JAX starts its backend; a cache
    directory already chosen is kept."""
    import tempfile

    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    cache = os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        os.path.join(tempfile.gettempdir(), f"shardplug-tests-jax-cache-{os.getuid()}"),
    )
    least = os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    jax = sys.modules.get("jax")  # imported already: its configuration read the environment
    if jax is not None and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(least))


def installed_strategies() -> list[str]:
    """Entry-point names in the group ``shardplug``, built-ins first, as the registry loads
    them (``SHARDPLUG_PLUGINS`` narrows third-party ones), without importing any of them."""
    selection = os.environ.get("SHARDPLUG_PLUGINS")
    chosen = {n.strip() for n in selection.split(",")} if selection is not None else None
    builtin, other = set(), set()
    for ep in importlib.metadata.entry_points(group="shardplug"):
        if ep.dist is not None and ep.dist.name == "shardplug":
            builtin.add(ep.name)
        elif chosen is None or ep.name in chosen:
            other.add(ep.name)
    return sorted(builtin) + sorted(other - builtin)


def installed_schedules() -> list[str]:
    """``gpipe`` and the built-in schedules (pp's registry), then those registered under
    ``shardplug.schedules``."""
    from shardplug.strategies.pp.schedules import SCHEDULES  # read when a matrix is made

    other = {ep.name for ep in importlib.metadata.entry_points(group="shardplug.schedules")}
    return ["gpipe", *SCHEDULES, *sorted(other - {"gpipe", *SCHEDULES})]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardplug", "shardplug strategy matrices")
    for kind in KINDS:
        group.addoption(
            f"--shardplug-{kind}",
            default=None,
            metavar="A,B",
            help=f"run the matrix over these {kind} only (env SHARDPLUG_{kind.upper()})",
        )
    group.addoption(
        "--shardplug-devices",
        type=int,
        default=None,
        help=f"simulated CPU devices (env SHARDPLUG_DEVICES, default {DEFAULT_DEVICES})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shardplug: a test of the shardplug matrix")
    devices = config.getoption("--shardplug-devices") or int(
        os.environ.get("SHARDPLUG_DEVICES", DEFAULT_DEVICES)
    )
    if "jax" in sys.modules:  # someone started JAX first: ask, it may be too late
        import jax

        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", devices)
    else:
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    available = {"strategies": installed_strategies(), "adapters": ADAPTERS, "models": MODELS,
                 "schedules": installed_schedules()}  # fmt: skip
    config._shardplug_matrix = {  # type: ignore[attr-defined]
        kind: _narrow(config, kind, list(available[kind])) for kind in KINDS
    }


def _narrow(config: pytest.Config, kind: str, available: list[str]) -> list[str]:
    wanted = config.getoption(f"--shardplug-{kind}") or os.environ.get(f"SHARDPLUG_{kind.upper()}")
    if not wanted:
        return available
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise pytest.UsageError(
            f"--shardplug-{kind}: unknown {', '.join(unknown)}; available: {', '.join(available)}"
        )
    return names


FIXTURES = {
    "shardplug_strategy": "strategies",
    "shardplug_adapter": "adapters",
    "shardplug_model": "models",
    "shardplug_schedule": "schedules",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    matrix = metafunc.config._shardplug_matrix  # type: ignore[attr-defined]
    for fixture, kind in FIXTURES.items():
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, matrix[kind], ids=matrix[kind])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The schedule matrix only for a conformance class whose strategy has a pipeline
    schedule to choose: for any other strategy its cells are deselected, not skipped."""
    takes = {id(item): _takes_schedules(item) for item in items}
    dropped = [item for item in items if not takes[id(item)]]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if takes[id(item)]]


def _takes_schedules(item: pytest.Item) -> bool:
    spec = getattr(item, "callspec", None)
    strategy = getattr(getattr(item, "cls", None), "strategy", None)
    if spec is None or "shardplug_schedule" not in spec.params or strategy is None:
        return True
    from shardplug.core.registry import strategy_options

    try:
        return "schedule" in {o.name for o in strategy_options(strategy)}
    except Exception:  # an unknown strategy: its own checks say so
        return True
