"""Strict JAX for every test: 8 simulated CPU devices, and no silent rank promotion.

(Strict dtype promotion would be stricter still, but optax's own Adam promotes a Python
float against an int32 step count, so it cannot be on here.)

The tests assert numbers, shardings and collectives, never speed, so XLA's CPU backend
skips its expensive LLVM optimisations: compilation, most of the suite's time, halves.
"""

import os
import tempfile

# shardplug's own tests see the built-in strategies only, whatever else is installed (the
# example package, say); tests of third-party loading set this themselves.
os.environ["SHARDPLUG_PLUGINS"] = ""
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

# Compiled programs are kept on disk and shared by the test processes (and the commands they
# start): the same small steps are compiled by many tests, and a kept one loads in a quarter
# of the time it takes to compile (the reference transformer's fsdp step: 2.0 s -> 0.5 s).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"shardplug-tests-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402
from helpers import reference_trainer  # noqa: E402


@pytest.fixture
def make_trainer():
    """``make_trainer(model, strategy, adapter=, optimizer=, addons=, **trainer_kwargs)`` ->
    ``(model, trainer)``: the one trainer factory of the suite."""
    return reference_trainer
