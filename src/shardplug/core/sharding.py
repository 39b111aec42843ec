"""Sharding rules shared by strategies, and the checks core applies to what strategies return."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core.mesh import is_explicit
from shardplug.errors import BatchError, PluginError


def lay_out_hint(exc: BaseException) -> str:
    """What to add to the error of a hook that failed because, on explicit mesh axes,
    ``jax.lax.with_sharding_constraint`` only asserts (JAX's own: core patches nothing); ""
    for any other error."""
    if "acts as an assert" not in str(exc):
        return ""
    return (
        " (on explicit mesh axes with_sharding_constraint only asserts: lay arrays out with "
        "shardplug.plugin.lay_out or jax.sharding.reshard, or declare 'explicit-axes' "
        "unsupported)"
    )


def lay_out(x: Any, where: P | NamedSharding) -> Any:
    """``x`` laid out as ``where`` says, inside a traced program, in either mesh mode: under
    ``AxisType.Explicit`` axes ``jax.sharding.reshard`` (where ``with_sharding_constraint``
    only asserts), under ``Auto`` axes ``with_sharding_constraint`` (where ``reshard`` is
    refused). ``P.UNCONSTRAINED`` entries keep what the array's type says under explicit axes.
    """
    spec = where.spec if isinstance(where, NamedSharding) else where
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty and isinstance(where, NamedSharding):
        mesh = where.mesh
    if not is_explicit(mesh):
        return jax.lax.with_sharding_constraint(x, where)
    if any(entry is P.UNCONSTRAINED for entry in spec):
        have = tuple(jax.typeof(x).sharding.spec) + (None,) * len(spec)
        spec = P(*(have[i] if e is P.UNCONSTRAINED else e for i, e in enumerate(spec)))
    return jax.sharding.reshard(x, spec)


def path_str(path: tuple[Any, ...]) -> str:
    """``('blocks', 0, 'mlp', 'kernel')`` as ``blocks/0/mlp/kernel``.

    The ``value`` attribute through which a Flax NNX variable holds its array is left out.
    """
    keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
    return jax.tree_util.keystr(tuple(keys), simple=True, separator="/")


def leaf_paths(tree: Any) -> list[str]:
    """The path of every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def per_parameter(
    rule: Callable[[tuple[int, ...], P], P], params: Any, annotations: Any | None
) -> Any:
    """Apply ``rule(shape, logical_spec)`` to every parameter; ``P()`` where there is no hint.

    The usual body of a ``shard_params`` hook:
    ``return per_parameter(lambda shape, logical: ..., params, annotations)``.
    """
    if annotations is None:
        return jax.tree.map(lambda p: rule(p.shape, P()), params)
    return jax.tree.map(lambda p, logical: rule(p.shape, logical), params, annotations)


def largest_divisible_dim(shape: tuple[int, ...], divisor: int) -> int | None:
    """The index of the largest dimension that ``divisor`` divides (the first among equals)."""
    best = None
    for i, size in enumerate(shape):
        if size % divisor == 0 and (best is None or size > shape[best]):
            best = i
    return best


def shard_largest_dim(shape: tuple[int, ...], axis: str, mesh: Mesh, min_size: int) -> P:
    """The size rule: split the largest dimension that divides ``axis``, or replicate.

    Arrays with fewer than ``min_size`` elements stay replicated: gathering them would cost
    more in latency than their memory is worth.
    """
    if math.prod(shape) < max(min_size, 1):
        return P()
    dim = largest_divisible_dim(shape, mesh.shape[axis])
    if dim is None:
        return P()
    return P(*(axis if i == dim else None for i in range(len(shape))))


def logical_to_mesh(shape: tuple[int, ...], logical: P, rules: Mapping[str, str], mesh: Mesh) -> P:
    """Map a spec of logical axis names onto mesh axes.

    A dimension is split over ``rules[name]`` when a rule exists, the mesh axis divides the
    dimension, and no earlier dimension already took that mesh axis; otherwise it stays whole.
    """
    used: set[str] = set()
    out: list[str | None] = []
    for size, name in zip(shape, (*logical, *(None,) * len(shape)), strict=False):
        axis = rules.get(name) if isinstance(name, str) else None
        if axis is not None and axis not in used and size % mesh.shape[axis] == 0:
            used.add(axis)
            out.append(axis)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def to_named(tree: Any, mesh: Mesh, *, plugin: str, hook: str, like: Any) -> Any:
    """Check a hook's answer against ``like`` and turn every leaf into a ``NamedSharding``."""
    paths, leaves = leaf_paths(like), jax.tree.leaves(like)
    specs, structure = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, (P, NamedSharding)))
    if structure != jax.tree.structure(like):
        raise PluginError(
            f"strategy {plugin!r}: {hook} returned a tree of {len(specs)} leaves that does not "
            f"match its input's {len(leaves)}; return one PartitionSpec or NamedSharding per "
            "leaf, in the input's tree structure (jax.tree.map over it)"
        )
    named = []
    for path, leaf, spec in zip(paths, leaves, specs, strict=True):
        kind = None
        if isinstance(spec, NamedSharding):
            spec, kind = spec.spec, spec.memory_kind
        if not isinstance(spec, P):
            raise PluginError(
                f"strategy {plugin!r}: {hook} returned {spec!r} for {path}; "
                "return a PartitionSpec or NamedSharding"
            )
        if len(spec) > len(leaf.shape):
            raise PluginError(
                f"strategy {plugin!r}: {hook} gave {path} of shape {leaf.shape} the spec {spec}, "
                "which has more entries than the array has dimensions"
            )
        unknown = set(mesh_axes(spec)) - set(mesh.axis_names)
        if unknown:
            raise PluginError(
                f"strategy {plugin!r}: {hook} gave {path} the spec {spec}, naming axes "
                f"{sorted(unknown)} that the mesh {tuple(mesh.axis_names)} does not have"
            )
        if hook != "shard_batch":  # a batch that does not split is the user's: BatchError
            _check_divides(spec, leaf.shape, mesh, f"strategy {plugin!r}: {hook}", path)
        if kind not in (None, "device") and hook == "shard_batch":
            raise PluginError(
                f"strategy {plugin!r}: shard_batch put {path} in memory {kind!r}, where a step "
                f"cannot read it: give the batch's layout alone (a PartitionSpec)"
            )
        named.append(NamedSharding(mesh, spec, memory_kind=kind))
    return jax.tree.unflatten(jax.tree.structure(like), named)


def _check_divides(spec: P, shape: tuple[int, ...], mesh: Mesh, who: str, path: str) -> None:
    for dim, entry in enumerate(spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            raise PluginError(
                f"{who} splits dimension {dim} of {path} (size {shape[dim]}) over {axes} "
                f"({parts} devices), which does not divide it: split only dimensions the axes "
                "divide (shardplug.plugin.largest_divisible_dim)"
            )


def mesh_axes(spec: P) -> list[str]:
    """Every mesh axis a spec splits over, in order."""
    axes: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return axes


def leading_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes a spec splits its first dimension over: the batch axes of a batch leaf."""
    first = spec[0] if len(spec) else None
    if first is None:
        return ()
    return (first,) if isinstance(first, str) else tuple(first)


def check_batch(batch: Any, shardings: Any) -> None:
    """Raise :class:`BatchError` if a split dimension of the batch does not divide its axes."""
    for path, leaf, sharding in zip(
        leaf_paths(batch), jax.tree.leaves(batch), jax.tree.leaves(shardings), strict=True
    ):
        for dim, entry in enumerate(sharding.spec):
            if entry is None:
                continue
            axes = entry if isinstance(entry, tuple) else (entry,)
            parts = math.prod(sharding.mesh.shape[a] for a in axes)
            if leaf.shape[dim] % parts:
                where = f"batch leaf {path!r}" if path else "the batch"
                raise BatchError(
                    f"{where} has {leaf.shape[dim]} rows in dimension {dim}, which do not "
                    f"split over the {parts} devices of mesh axes {axes}: "
                    f"use a global batch size that is a multiple of {parts}"
                )


def optimizer_shardings(
    optimizer: optax.GradientTransformation,
    abstract_params: Any,
    param_shardings: Any,
    replicated: NamedSharding,
) -> Any:
    """Shard every optimizer-state leaf like the parameter it mirrors; replicate the rest.

    Adam's ``mu`` and ``nu`` follow their parameters, a step count is replicated. This uses
    optax's own knowledge of which state leaves are per-parameter, so it holds for any optax
    transformation, chained ones included.
    """
    masked = optax.transforms.MaskedNode  # a masked-out parameter's place: no state

    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda state, sharding: state if isinstance(state, masked) else sharding,
        jax.eval_shape(optimizer.init, abstract_params),
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, masked),
    )
