"""Faster compiles for this package's tests (the tests pass without it). The conformance suite
compares numbers and shardings, not speed, so XLA's CPU backend may skip its expensive LLVM
optimisations, and the one-device references it compiles for every strategy are kept in JAX's
persistent compilation cache, shared by pytest-xdist's workers (and shardplug's own tests)."""

import os
import tempfile

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
# in the environment too, for the commands the tests start (shardplug train)
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"shardplug-tests-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax

if not jax.config.jax_compilation_cache_dir:  # JAX was imported before the environment was set
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
