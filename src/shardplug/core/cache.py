"""JAX's persistent compilation cache, and the programs compiled outside it.

A program XLA:CPU loads from the cache (JAX 0.12.0.1; 0.10.2 is not affected) runs its
collectives in an order of its own on each device, where the same program freshly compiled
keeps one order on all: the optimized HLO of the two is the same, line for line, and the
loaded one waits forever (XLA aborts it after 40 s) where two of its collectives depend on
no data of each other. pp's ticks are such a program: its sends round the stage ring and
the values leaving the region are conditionals that every device takes alike, ordered by
``optimization_barrier`` alone, which XLA removes once it has scheduled them. Such programs,
collectives inside conditionals on CPU devices, are compiled afresh; so is a program for a
GPU that is not here (``--target``), which JAX writes to the cache and cannot load back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: the collectives of a manual region (``shard_map``), as JAX names their primitives
COLLECTIVES = frozenset({"ppermute", "psum", "psum_invariant", "pmax", "pmin", "all_gather",
                         "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter",
                         "all_gather_invariant", "psend", "precv"})  # fmt: skip


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Compile within this block afresh: neither loaded from JAX's persistent compilation
    cache nor written to it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether it uses the cache
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def subjaxprs(eqn: Any) -> Iterator[Any]:
    """The programs an equation runs (a cond's branches, a scan's body, a call's jaxpr)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield inner


def _collective_within(jaxpr: Any) -> bool:
    return any(eqn.primitive.name in COLLECTIVES or any(map(_collective_within, subjaxprs(eqn)))
               for eqn in jaxpr.eqns)  # fmt: skip


def collectives_in_conditionals(jaxpr: Any) -> bool:
    """Whether a traced program runs a collective inside a ``cond`` (or ``switch``)."""

    def find(jaxpr: Any) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cond" and any(map(_collective_within, subjaxprs(eqn))):
                return True
            if any(map(find, subjaxprs(eqn))):
                return True
        return False

    return find(getattr(jaxpr, "jaxpr", jaxpr))


def keep_out(jaxpr: Any, device: Any) -> bool:
    """Whether a program for ``device``'s kind is compiled outside the cache: for a GPU that
    is not here (a compile-only device, whose program JAX cannot load back), or with
    collectives inside conditionals, on CPU devices, with a JAX after 0.10."""
    import jax

    from shardplug.core.devices import is_compile_only

    if not jax.config.jax_compilation_cache_dir:
        return False
    if is_compile_only(device):
        return True
    if device.platform != "cpu":
        return False
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
        return False
    return collectives_in_conditionals(jaxpr)


def compile_step(lowered: Any, jaxpr: Any, device: Any) -> Any:
    """``lowered.compile()``, outside the cache where :func:`keep_out` says so."""
    if keep_out(jaxpr, device):
        with uncached():
            return lowered.compile()
    return lowered.compile()
