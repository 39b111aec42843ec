"""Faster compiles for this package's tests (the tests pass without it). The conformance suite
compares numbers and shardings, not speed, so XLA's CPU backend may skip its expensive LLVM
optimisations, and the one-device references it compiles for every strategy are kept in JAX's
persistent compilation cache, shared by pytest-xdist's workers (and shardplug's own tests)."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

import jax

if not jax.config.jax_compilation_cache_dir:
    cache = os.path.join(tempfile.gettempdir(), f"shardplug-tests-jax-cache-{os.getuid()}")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
