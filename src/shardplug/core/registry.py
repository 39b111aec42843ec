"""Finding strategies by name, and the per-run plugin manager that answers the hooks.

Strategies come from the entry-point group ``shardplug``: the built-ins are declared in
shardplug's own ``pyproject.toml`` exactly as a third-party package declares its own. Each
entry point is loaded inside its own guard, so a broken plugin is reported by name and never
takes the others down.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from shardplug.core import fallbacks, hookspecs
from shardplug.core.sharding import check_batch, to_named
from shardplug.errors import (
    PluginError,
    ShardplugError,
    StrategyOptionError,
    UnknownStrategyError,
)

GROUP = "shardplug"
BUILTIN_PACKAGE = "shardplug"


@dataclasses.dataclass(frozen=True)
class StrategyOption:
    """One keyword a strategy accepts through ``get_strategy(name, **options)``."""

    name: str
    type: str
    default: Any


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """What the registry knows of one installed strategy, before it is used."""

    name: str
    description: str
    package: str
    version: str
    options: tuple[StrategyOption, ...] = ()

    @property
    def builtin(self) -> bool:
        return self.package == BUILTIN_PACKAGE

    @property
    def source(self) -> str:
        return "built-in" if self.builtin else f"{self.package} {self.version}"


@dataclasses.dataclass(frozen=True)
class _Entry:
    info: StrategyInfo | None
    plugin: Any = None
    error: str | None = None


def _describe(plugin: Any) -> str:
    text = getattr(plugin, "description", None) or inspect.getdoc(plugin) or ""
    return text.strip().splitlines()[0] if text.strip() else "(no description)"


def _options(plugin: Any) -> tuple[StrategyOption, ...]:
    if not inspect.isclass(plugin):
        return ()
    found = []
    for param in inspect.signature(plugin).parameters.values():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        kind = (
            param.annotation
            if isinstance(param.annotation, str)
            else getattr(param.annotation, "__name__", "any")
        )
        default = None if param.default is param.empty else param.default
        found.append(StrategyOption(param.name, kind, default))
    return tuple(found)


def _load(ep: importlib.metadata.EntryPoint) -> _Entry:
    package = ep.dist.name if ep.dist is not None else "?"
    version = ep.dist.version if ep.dist is not None else "?"
    try:
        plugin = ep.load()
    except Exception as exc:  # a broken plugin must not take the others down
        return _Entry(
            None, error=f"{package} {version}: import failed: {type(exc).__name__}: {exc}"
        )
    info = StrategyInfo(ep.name, _describe(plugin), package, version, _options(plugin))
    return _Entry(info, plugin)


@functools.cache
def _discover() -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        entry = _load(ep)
        if ep.name in entries:
            first, second = entries[ep.name], entry
            providers = [
                e.info.source if e.info else (e.error or "?").split(":")[0] for e in (first, second)
            ]
            entry = _Entry(
                None,
                error=f"claimed by two packages ({providers[0]} and {providers[1]}); "
                "uninstall one of them",
            )
        entries[ep.name] = entry
    return entries


def list_strategies() -> list[StrategyInfo]:
    """Every strategy that loaded, built-ins first, then by name."""
    infos = [e.info for e in _discover().values() if e.info is not None and e.error is None]
    return sorted(infos, key=lambda i: (not i.builtin, i.name))


def get_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called ``name``, configured with ``options``.

    >>> get_strategy("fsdp", min_size=0).name
    'fsdp'

    Raises :class:`UnknownStrategyError` (listing the available names) for an unknown name,
    :class:`StrategyOptionError` for an option it does not take, and :class:`PluginError`
    when the plugin under that name could not be loaded.
    """
    entries = _discover()
    entry = entries.get(name)
    if entry is None:
        raise UnknownStrategyError(name, (n for n, e in entries.items() if e.error is None))
    if entry.error is not None:
        raise PluginError(f"strategy {name!r} cannot be used: {entry.error}")
    assert entry.info is not None
    return Strategy(entry.info, _instantiate(entry.info, entry.plugin, options))


def _instantiate(info: StrategyInfo, plugin: Any, options: Mapping[str, Any]) -> Any:
    accepted = {o.name for o in info.options}
    unknown = sorted(set(options) - accepted)
    if unknown:
        takes = ", ".join(f"{o.name} (default {o.default!r})" for o in info.options) or "none"
        raise StrategyOptionError(
            f"strategy {info.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {takes}"
        )
    if not inspect.isclass(plugin):
        return plugin
    try:
        return plugin(**options)
    except ShardplugError:
        raise
    except (TypeError, ValueError) as exc:
        raise StrategyOptionError(f"strategy {info.name!r}: bad option: {exc}") from None


class Strategy:
    """One run's strategy: a pluggy manager holding core's fallbacks and the named plugin.

    Its methods call the hooks with keyword arguments, check what comes back, and name the
    strategy and the hook in every error.
    """

    def __init__(self, info: StrategyInfo, plugin: Any):
        self.info = info
        self.plugin = plugin
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(fallbacks, name="shardplug.core.fallbacks")
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"strategy {info.name!r} does not fit the hook specs: {exc}"
            ) from None

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"Strategy({self.name!r}, {self.info.source})"

    def _call(self, hook: str, **kwargs: Any) -> Any:
        caller: Callable[..., Any] = getattr(self.pm.hook, hook)
        try:
            return caller(**kwargs)
        except ShardplugError:
            raise
        except Exception as exc:
            raise PluginError(
                f"strategy {self.name!r}: hook {hook} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def make_mesh(self, devices: list[Any], mesh_shape: dict[str, int] | None) -> Any:
        from jax.sharding import Mesh

        mesh = self._call("make_mesh", devices=devices, mesh_shape=mesh_shape)
        if not isinstance(mesh, Mesh):
            raise PluginError(f"strategy {self.name!r}: make_mesh returned {mesh!r}, not a Mesh")
        if sorted(d.id for d in mesh.devices.flat) != sorted(d.id for d in devices):
            raise PluginError(
                f"strategy {self.name!r}: make_mesh built a mesh over other devices "
                f"than the {len(devices)} it was given"
            )
        return mesh

    def shard_params(self, params: Any, mesh: Any, annotations: Any | None) -> Any:
        specs = self._call("shard_params", params=params, mesh=mesh, annotations=annotations)
        return to_named(specs, mesh, plugin=self.name, hook="shard_params", like=params)

    def shard_batch(self, batch: Any, mesh: Any) -> Any:
        specs = self._call("shard_batch", batch=batch, mesh=mesh)
        shardings = to_named(specs, mesh, plugin=self.name, hook="shard_batch", like=batch)
        check_batch(batch, shardings)
        return shardings

    def gather_params(self, params: Any, mesh: Any) -> Any:
        return self._call("gather_params", params=params, mesh=mesh)

    def reduce_grads(self, grads: Any, mesh: Any) -> Any:
        return self._call("reduce_grads", grads=grads, mesh=mesh)

    def compile_step(
        self, step_fn: Callable, mesh: Any, state_shardings: Any, batch_shardings: Any
    ) -> Callable:
        return self._call(
            "compile_step",
            step_fn=step_fn,
            mesh=mesh,
            state_shardings=state_shardings,
            batch_shardings=batch_shardings,
        )
