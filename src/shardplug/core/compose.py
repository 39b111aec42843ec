"""Parallelisms composed on one mesh: ``"a+b+c"`` as one strategy.

Each parallelism owns one mesh axis (:func:`~shardplug.core.hookspecs.parallel_axis`), whose
``Axis.rank`` places it. Core composes them in one order, derived from the ranks alone:

- **the mesh** lays the axes out by rank, outermost (lowest) first: replicas, with the
  least traffic, across nodes; the axis whose parallelism talks every layer, on the fastest
  links, innermost (as MaxText lays out its mesh);
- **parameters** are split in the reverse order, innermost first, like torchtitan's
  ``parallelize`` (tensor parallel, then pipeline stages, then sharding of what remains):
  each parallelism claims its dimensions among those the ones before it left
  (:func:`~shardplug.core.hookspecs.split_param`);
- **the batch**: each parallelism says which dimension of each batch leaf it splits
  (:func:`~shardplug.core.hookspecs.split_batch`; by default the leading one where its
  ``Axis`` says ``batch``), and a dimension several split is split over their axes in mesh
  order;
- **the step** sees each parameter as every parallelism's
  :func:`~shardplug.core.hookspecs.gather_param` leaves it, in mesh order.

:func:`order` states the orders of a composition; ``explain`` prints them. Two parallelisms
on one axis, or claiming one dimension of one parameter, are refused with a
:class:`~shardplug.errors.CompositionError` naming both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import pluggy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplug.core import declared, fallbacks, hookspecs, ops
from shardplug.core.hookspecs import Axis, hookimpl
from shardplug.core.mesh import build_mesh, is_explicit
from shardplug.core.operations.layer_stack import LAYERS
from shardplug.core.sharding import lay_out, lay_out_hint, leaf_paths, mesh_axes
from shardplug.errors import (
    CompositionError,
    ConfigError,
    MeshError,
    PluginError,
    ShardplugError,
    one_line,
)

#: hooks of the step a parallelism may also implement; one per composition.
STEP_HOOKS = (
    "compute_grads",
    "reduce_grads",
    "encode_grads",
    "compile_step",
    "shard_model_state",
)


@dataclasses.dataclass(frozen=True)
class Composed:
    """An entry point that names a composition: ``both = "...:BOTH"`` with
    ``BOTH = Composed("a+b", "a and b on one mesh")`` makes ``--strategy both`` mean ``a+b``.

    A declaration only; the run's plugin for a composition is :class:`CompositionPlugin`."""

    parts: str
    description: str = ""


@dataclasses.dataclass
class Part:
    """One parallelism of a composition: its plugin, its axis as this run names it."""

    name: str
    plugin: Any
    axis: Axis
    pm: pluggy.PluginManager

    def call(self, hook: str, **kwargs: Any) -> Any:
        """``hook`` asked of this parallelism alone (core's fallback where it has none)."""
        others = [p for p in self.pm.get_plugins() if p is not self.plugin and p is not fallbacks]
        try:
            return self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)
        except ShardplugError:
            raise
        except Exception as exc:
            raise PluginError(
                f"parallelism {self.name!r}: hook {hook} failed: {type(exc).__name__}: "
                f"{one_line(exc)}"
                f"{lay_out_hint(exc)}"
            ) from exc


def _is_sequence(leaf: Any, sequences: tuple[int, ...] | None) -> bool | None:
    """Whether ``leaf``'s second dimension is a sequence, as far as the lengths the model's
    attention read say (:func:`~shardplug.core.hookspecs.split_batch`'s ``sequence``)."""
    if leaf.ndim < 2:
        return False
    if sequences:  # tokens fed as tokens[:, :-1] are one longer than what attention reads
        return leaf.shape[1] in sequences or leaf.shape[1] - 1 in sequences
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        return True  # token ids: a sequence, whatever computes the model's attention
    return None if sequences is None else False


def implemented(plugin: Any) -> set[str]:
    """The hooks ``plugin`` implements (names of methods carrying a hookimpl marker)."""
    found = set()
    for attr in dir(plugin):
        method = getattr(plugin, attr, None)
        if callable(method) and hasattr(method, f"{hookspecs.PROJECT}_impl"):
            found.add(attr)
    return found


def make_part(name: str, plugin: Any, renames: Mapping[str, str], pm: pluggy.PluginManager) -> Part:
    """``plugin`` (a parallelism: the registry refuses whole strategies before) registered in
    the run's plugin manager ``pm`` as a part, its axis renamed as the run asks."""
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{name!r} does not fit the hook specs: {exc}") from None
    axis = Part(name, plugin, None, pm).call("parallel_axis")  # type: ignore[arg-type]
    if not isinstance(axis, Axis):
        raise PluginError(f"parallelism {name!r}: parallel_axis returned {axis!r}, not an Axis")
    axis = dataclasses.replace(axis, name=renames.get(axis.name, axis.name))
    return Part(name, plugin, axis, pm)


def default_sizes(count: int, parts: int) -> list[int]:
    """``count`` devices as ``parts`` factors, as even as divisibility allows, larger ones
    first (outer axes): 8 over three axes is 2x2x2, over two 4x2 (replicas 4, tensor
    parallelism 2: it talks every layer, so it gets the smaller factor)."""
    sizes = []
    for left in range(parts, 0, -1):
        size = next(d for d in range(1, count + 1) if count % d == 0 and d**left >= count)
        sizes.append(size)
        count //= size
    return sizes


class CompositionPlugin:
    """The whole-strategy hooks of a composition, answered from its parallelisms.

    Core builds it from names (``get_strategy("a+b")``); it is the plugin of the run's
    :class:`~shardplug.core.registry.Strategy`, next to the parallelisms' own step hooks.
    """

    def __init__(self, parts: Sequence[Part]):
        by_axis: dict[str, Part] = {}
        for part in parts:
            if part.axis.name in by_axis:
                raise CompositionError(
                    f"{by_axis[part.axis.name].name!r} and {part.name!r} both claim the mesh "
                    f"axis {part.axis.name!r}: compose parallelisms of different axes, or "
                    f"rename one with --axis-name"
                )
            by_axis[part.axis.name] = part
        for hook in STEP_HOOKS:
            owners = [p.name for p in parts if hook in implemented(p.plugin)]
            if len(owners) > 1:
                raise CompositionError(
                    f"{owners[0]!r} and {owners[1]!r} both implement {hook}: a composition "
                    f"takes each step hook from one parallelism at most"
                )
        self.parts = sorted(parts, key=lambda p: p.axis.rank)  # mesh order, outer first
        self._stored: dict[Any, list[P]] = {}
        self._fixed: dict[Any, list[dict[int, Any]]] = {}
        self._stacked: dict[Any, list[bool]] = {}

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(p.axis.name for p in self.parts)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(p.axis.name for p in self.parts if p.axis.batch)

    @property
    def unsupported(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for part in self.parts:
            found.update(declared.declared(part.plugin, "unsupported"))
        if self.batch_axes:
            found.pop(declared.Capability.BATCH_SPLIT, None)
        return found

    def activation_rules(self) -> dict[str, tuple[str, ...]]:
        """Logical activation name -> mesh axes, for :func:`shardplug.constrain`."""
        rules: dict[str, tuple[str, ...]] = {}
        if self.batch_axes:
            rules["batch"] = self.batch_axes
        for part in self.parts:
            for name in part.axis.logical:
                rules[name] = (*rules.get(name, ()), part.axis.name)
        return rules

    @hookimpl
    def make_mesh(self, devices, mesh_shape):
        shape = dict(mesh_shape or {})
        # an axis no parallelism owns, of size 1: a name the model's own code uses, kept whole
        extra = {a: n for a, n in shape.items() if a not in self.axes and n == 1}
        unknown = sorted(set(shape) - set(self.axes) - set(extra))
        if unknown:
            roles = ", ".join(f"{p.axis.name} ({p.name})" for p in self.parts)
            raise MeshError(
                f"mesh axis {unknown[0]!r} is not an axis of this composition, whose axes are "
                f"{roles}: size those, rename one to match your model (--axis-name "
                f"ROLE={unknown[0]}), or give it size 1 to keep a name your model uses whole"
            )
        given = math.prod(shape.values())
        rest = [a for a in self.axes if a not in shape]
        if len(devices) % given:
            asked = ",".join(f"{k}={v}" for k, v in shape.items())
            raise MeshError(
                f"mesh {asked} has {given} devices but the run has {len(devices)}: make the "
                f"sizes multiply to {len(devices)}, or change --devices"
            )
        shape.update(zip(rest, default_sizes(len(devices) // given, len(rest)), strict=True))
        sizes = {a: shape[a] for a in (*self.axes, *extra)}
        return build_mesh(devices, sizes, default=dict.fromkeys(sizes, 1))

    @hookimpl
    def shard_params(self, params, mesh, annotations):
        paths = leaf_paths(params)
        leaves, treedef = jax.tree.flatten(params)
        logicals = (
            [P()] * len(leaves)
            if annotations is None
            else jax.tree.leaves(annotations, is_leaf=lambda x: isinstance(x, P))
        )
        fixed = [
            self._model_placed(path, leaf.shape, logical, mesh)
            for path, leaf, logical in zip(paths, leaves, logicals, strict=True)
        ]
        specs = [
            self._spec(path, leaf.shape, logical, mesh, own)
            for path, leaf, logical, own in zip(paths, leaves, logicals, fixed, strict=True)
        ]
        for part in self.parts:
            part.call("check_layout", paths=paths, specs=specs, axis=part.axis.name,
                      leaves=leaves, logical=logicals)  # fmt: skip
        self._stored[(treedef, id(mesh))] = specs
        self._fixed[(treedef, id(mesh))] = fixed
        self._stacked[(treedef, id(mesh))] = [
            len(logical) > 0 and logical[0] == LAYERS for logical in logicals
        ]
        return jax.tree.unflatten(treedef, specs)

    def _model_placed(self, path: str, shape: Any, logical: P, mesh: Any) -> dict[int, Any]:
        """On explicit axes, the dimensions the model's annotation places on mesh axes, and
        their entries: the model's code uses them so (its types say so), so they are stored
        and used as it says; the parallelisms split only the dimensions it leaves unnamed.
        Empty on auto axes, where the parallelisms' rules decide. A mesh axis that does not
        divide its dimension is refused, naming both."""
        if not is_explicit(mesh):
            return {}
        # a logical name a parallelism maps is not the mesh axis of that name it may share
        axes = set(mesh.axis_names) - {n for p in self.parts for n in p.axis.logical}
        fixed = {}
        for dim, entry in enumerate(tuple(logical)[: len(shape)]):
            entries = entry if isinstance(entry, tuple) else (entry,)
            kept = tuple(e for e in entries if e in axes)
            if not kept:
                continue
            parts = math.prod(mesh.shape[a] for a in kept)
            if shape[dim] % parts:
                raise CompositionError(
                    f"{path} (shape {tuple(shape)}): the model places dimension {dim} over "
                    f"{kept} ({parts} devices), which does not divide its {shape[dim]}: size "
                    f"the mesh so that it does (--mesh), or change the model's annotation"
                )
            fixed[dim] = kept[0] if len(kept) == 1 else kept
        return fixed

    def part_contexts(self, mesh: Any) -> list[Any]:
        """The context managers entered around every traced program: the parallelisms'
        operations (:mod:`shardplug.core.ops`)."""
        split = {a for key, specs in self._stored.items() if key[1] == id(mesh)
                 for spec in specs for a in mesh_axes(spec)}  # fmt: skip
        replicas = tuple(a for a in self.batch_axes if split and a not in split)
        asked = dict(mesh=mesh, replicas=replicas, batch_axes=self.batch_axes)
        records = [(p.name, p.call("operations", axis=p.axis.name, **asked)) for p in self.parts]
        return [ops.supplying(records)]

    def _spec(
        self, path: str, shape: tuple[int, ...], logical: P, mesh: Any, fixed: dict[int, Any]
    ) -> P:
        owner: dict[int, Part | None] = dict.fromkeys(fixed)  # the model's own dimensions
        axes: dict[int, tuple[str, ...]] = {
            d: e if isinstance(e, tuple) else (e,) for d, e in fixed.items()
        }
        model_axes = {a for entry in axes.values() for a in entry}
        inner = list(reversed(self.parts))  # claims innermost first (compose.order)
        for i, part in enumerate(inner):
            axis = part.axis.name
            if axis in model_axes:  # the model uses it for this parameter already
                continue
            spare = {
                p.axis.name: mesh.shape[p.axis.name]
                for p in reversed(inner[:i])
                if p.axis.lends and p not in owner.values() and p.axis.name not in model_axes
            }
            got = part.call(
                "split_param", shape=tuple(shape), logical=logical, axis=axis,
                size=mesh.shape[axis], taken=frozenset(owner), spare=spare,
            )  # fmt: skip
            if got is None:
                continue
            dim, borrowed = got if isinstance(got, tuple) else (got, ())
            if not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise PluginError(
                    f"parallelism {part.name!r}: split_param chose dimension {dim!r} of {path} "
                    f"(shape {tuple(shape)}), which it does not have"
                )
            if dim in owner:
                first = "the model" if owner[dim] is None else repr(owner[dim].name)
                raise CompositionError(
                    f"{first} and {part.name!r} both split dimension {dim} of "
                    f"{path} (shape {tuple(shape)}): a dimension splits over one parallelism's "
                    f"axis; change the rules of one of them"
                )
            if not set(borrowed) <= set(spare):
                raise PluginError(
                    f"parallelism {part.name!r}: split_param borrowed axes {borrowed} for "
                    f"{path}; only {tuple(spare)} were spare"
                )
            parts = math.prod(mesh.shape[a] for a in (axis, *borrowed))
            if shape[dim] % parts:
                raise PluginError(
                    f"parallelism {part.name!r}: split_param split dimension {dim} of {path} "
                    f"({shape[dim]}) over {parts} devices, which do not divide it"
                )
            owner[dim], axes[dim] = part, (axis, *borrowed)
        out = [
            None if d not in axes else axes[d][0] if len(axes[d]) == 1 else axes[d]
            for d in range(len(shape))
        ]
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    @hookimpl
    def shard_batch(self, batch, mesh, sequences):
        paths, leaves = leaf_paths(batch), jax.tree.leaves(batch)
        entries: list[list[list[str]]] = [[[] for _ in leaf.shape] for leaf in leaves]
        known = [_is_sequence(leaf, sequences) for leaf in leaves]
        for part in self.parts:  # mesh order: a dimension's axes in it
            axis, size = part.axis.name, mesh.shape[part.axis.name]
            own = "split_batch" in implemented(part.plugin)
            for path, leaf, dims, sequence in zip(paths, leaves, entries, known, strict=True):
                if own:
                    dim = part.call("split_batch", path=path, shape=tuple(leaf.shape),
                                    axis=axis, size=size, sequence=sequence)  # fmt: skip
                else:
                    dim = 0 if part.axis.batch and leaf.ndim else None
                if dim is None:
                    continue
                if not isinstance(dim, int) or not 0 <= dim < leaf.ndim:
                    raise PluginError(
                        f"parallelism {part.name!r}: split_batch chose dimension {dim!r} of "
                        f"batch leaf {path!r} (shape {tuple(leaf.shape)}), which it does not have"
                    )
                dims[dim].append(axis)
            if sequences is not None and not any(known):
                self._check_sequence(part, paths, leaves, entries)
        specs = [_trimmed([_entry(axes) for axes in dims]) for dims in entries]
        return jax.tree.unflatten(jax.tree.structure(batch), specs)

    @staticmethod
    def _check_sequence(part: Part, paths: list[str], leaves: list[Any], entries: Any) -> None:
        """Refuse a parallelism that splits sequences (it declares ``without-sequence``
        unsupported) on a traced batch with none, unless it split a leaf of its own accord."""
        reason = declared.declared(part.plugin, "unsupported").get(
            declared.Capability.WITHOUT_SEQUENCE
        )
        axis = part.axis.name
        if reason is None or any(axis in axes for dims in entries for axes in dims):
            return
        shapes = ", ".join(f"{p} {tuple(x.shape)}" for p, x in zip(paths, leaves, strict=True))
        raise ConfigError(
            f"{part.name}: the model has no sequence to split: no leaf of its batch ({shapes}) "
            f"has a second dimension its shardplug.attention reads, nor holds token ids; "
            f"{reason}"
        )

    def used_spec(self, spec: P, fixed: Mapping[int, Any] | None = None) -> P:
        """A parameter's layout where the step uses it, given its stored ``spec`` (and the
        dimensions the model places itself, ``fixed``: used as it says)."""
        for part in self.parts:
            spec = part.call("gather_param", spec=spec, axis=part.axis.name)
        if not fixed:
            return spec
        out = list(spec) + [None] * (max(fixed, default=-1) + 1 - len(spec))
        for dim, entry in fixed.items():
            out[dim] = entry
        return _trimmed(out)

    def used_specs(self, params: Any, mesh: Any) -> list[P] | None:
        """Every parameter's layout where the step uses it, in ``jax.tree.leaves`` order
        (None for parameters this composition did not place)."""
        key = (jax.tree.structure(params), id(mesh))
        stored = self._stored.get(key)
        if stored is None:
            return None
        return [self.used_spec(s, f) for s, f in zip(stored, self._fixed[key], strict=True)]

    @hookimpl
    def gather_params(self, params, mesh):
        """The parameters as the step uses them; a layer stack's are left as stored, to be
        gathered one layer at a time inside its loop (:meth:`layer_gathers`): gathering a
        whole stack before its scan would hold every layer at once."""
        leaves, treedef = jax.tree.flatten(params)
        used_specs = self.used_specs(params, mesh)
        if used_specs is None:
            return params
        stored = self._stored[(treedef, id(mesh))]
        stacked = self._stacked[(treedef, id(mesh))]
        out = [
            lay_out(leaf, NamedSharding(mesh, used))
            if tuple(used) != tuple(spec) and not in_stack
            else leaf
            for leaf, spec, used, in_stack in zip(leaves, stored, used_specs, stacked, strict=True)
        ]
        return jax.tree.unflatten(treedef, out)

    def layer_gathers(self, params: Any, mesh: Any) -> dict[int, P]:
        """The layer stacks' leaves of ``params`` to gather one layer at a time, by id, with
        their layout where the step uses them (for
        :func:`shardplug.core.operations.layer_gather.layer_specs`)."""
        leaves, treedef = jax.tree.flatten(params)
        used_specs = self.used_specs(params, mesh)
        if used_specs is None:
            return {}
        stored = self._stored[(treedef, id(mesh))]
        stacked = self._stacked[(treedef, id(mesh))]
        return {
            id(leaf): used
            for leaf, spec, used, in_stack in zip(leaves, stored, used_specs, stacked, strict=True)
            if in_stack and tuple(used) != tuple(spec)
        }


def _entry(axes: Sequence[str]) -> Any:
    """A PartitionSpec entry for a dimension split over ``axes`` (None, a name, a tuple)."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def order(parts: Sequence[Part]) -> dict[str, list[str]]:
    """The orders of a composition, from its axes' ranks: ``mesh`` (outermost first) and
    ``claims`` (the order parameter dimensions are claimed in, innermost first)."""
    mesh = [p.axis.name for p in sorted(parts, key=lambda p: p.axis.rank)]
    return {"mesh": mesh, "claims": mesh[::-1]}


def _trimmed(entries: list[Any]) -> P:
    """``entries`` as a PartitionSpec without its trailing ``None``s."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def parse(name: str) -> list[str]:
    """``"a+b+c"`` into ``["a", "b", "c"]``; refuses empty and repeated names."""
    names = [n.strip() for n in name.split("+")]
    if not all(names):
        raise CompositionError(
            f"malformed composition {name!r}: write parallelism names joined by '+' (a+b)"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CompositionError(f"composition {name!r} names {repeated[0]!r} twice")
    return names
