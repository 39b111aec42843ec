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
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pluggy

from shardplug.core import compose, declared, fallbacks, hookspecs
from shardplug.core.strategy import BUILTIN_PACKAGE, StrategyInfo, StrategyOption
from shardplug.core.strategy import Strategy as Strategy  # re-exported: the run's manager
from shardplug.errors import (
    CompositionError,
    ConfigError,
    MeshError,
    PluginError,
    ShardplugError,
    ShardplugWarning,
    StrategyOptionError,
    UnknownStrategyError,
    one_line,
)

GROUP = "shardplug"
ADDON_GROUP = "shardplug.addons"
SELECT_ENV = "SHARDPLUG_PLUGINS"


def _describe(plugin: Any) -> str:
    text = declared.declared(plugin, "description") or inspect.getdoc(plugin) or ""
    return text.strip().splitlines()[0] if text.strip() else "(no description)"


def _options(plugin: Any) -> tuple[StrategyOption, ...]:
    if not inspect.isclass(plugin):
        return ()
    found = []
    for param in inspect.signature(plugin).parameters.values():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        annotation = param.annotation
        kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "any")
        default = None if param.default is param.empty else param.default
        found.append(StrategyOption(param.name, kind, default))
    return tuple(found)


def _hooks(plugin: Any) -> tuple[str, ...]:
    """The hooks ``plugin`` implements; raises PluginValidationError if they misfit the specs."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="candidate")
    pm.check_pending()
    return tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))


def _load(entry: importlib.metadata.EntryPoint) -> tuple[StrategyInfo, Any]:
    package = entry.dist.name if entry.dist is not None else "?"
    version = entry.dist.version if entry.dist is not None else "?"
    broken = functools.partial(StrategyInfo, entry.name, "(failed to load)", package, version)
    try:
        plugin = entry.load()
    except Exception as exc:  # a broken plugin must not take the others down
        return broken(error=f"import failed: {type(exc).__name__}: {one_line(exc)}"), None
    if isinstance(plugin, compose.Composed):
        description = plugin.description or f"the composition {plugin.parts}"
        info = StrategyInfo(
            entry.name, description, package, version, kind="composition", parts=plugin.parts
        )
        return info, plugin
    try:
        hooks = _hooks(plugin)
    except pluggy.PluginValidationError as exc:
        return broken(error=f"hooks do not fit the specs: {exc}"), None
    try:
        for field in ("capabilities", "unsupported", "baseline"):
            declared.declared(plugin, field)
        description = _describe(plugin)
    except PluginError as exc:
        return broken(error=str(exc)), None
    kind = "parallelism" if "parallel_axis" in hooks else "strategy"
    info = StrategyInfo(
        entry.name, description, package, version, _options(plugin), hooks, kind=kind
    )
    return info, plugin


def _selected(entry: importlib.metadata.EntryPoint, selection: str | None) -> bool:
    if entry.dist is not None and entry.dist.name == BUILTIN_PACKAGE:
        return True
    if selection is None:
        return True
    return entry.name in {name.strip() for name in selection.split(",") if name.strip()}


@functools.cache
def _discover(group: str, selection: str | None) -> dict[str, tuple[StrategyInfo, Any]]:
    entries: dict[str, tuple[StrategyInfo, Any]] = {}
    for entry in importlib.metadata.entry_points(group=group):
        if not _selected(entry, selection):
            continue
        info, plugin = _load(entry)
        if entry.name in entries:
            first = entries[entry.name][0]
            info = dataclasses.replace(
                info,
                error=f"claimed by two packages, {first.package} {first.version} and "
                f"{info.package} {info.version}: uninstall one of them",
            )
            plugin = None
        entries[entry.name] = (info, plugin)
    for info, _ in entries.values():
        if info.error is not None:
            warnings.warn(
                f"shardplug plugin {info.name!r} ({info.package} {info.version}) cannot be "
                f"used: {info.error}",
                ShardplugWarning,
                stacklevel=2,
            )
    return entries


def _entries(group: str) -> dict[str, tuple[StrategyInfo, Any]]:
    return _discover(group, os.environ.get(SELECT_ENV))


def _listing(group: str, include_broken: bool) -> list[StrategyInfo]:
    infos = [info for info, _ in _entries(group).values()]
    if not include_broken:
        infos = [i for i in infos if i.error is None]
    return sorted(infos, key=lambda i: (not i.builtin, i.name))


def list_strategies(include_broken: bool = False) -> list[StrategyInfo]:
    """Every strategy that loaded, built-ins first, then by name.

    ``SHARDPLUG_PLUGINS`` (comma-separated names; empty for built-ins only) narrows which
    installed third-party plugins load. ``include_broken`` adds those that failed, with
    their ``error``.
    """
    return _listing(GROUP, include_broken)


def list_addons(include_broken: bool = False) -> list[StrategyInfo]:
    """Every add-on plugin (entry-point group ``shardplug.addons``) that loaded."""
    return _listing(ADDON_GROUP, include_broken)


def _lookup(group: str, name: str, kind: str) -> tuple[StrategyInfo, Any]:
    entries = _entries(group)
    if name not in entries:
        available = [n for n, (info, _) in entries.items() if info.error is None]
        if group == GROUP:
            raise UnknownStrategyError(name, available, kind=kind)
        raise UnknownStrategyError(name, available, kind="add-on")
    info, plugin = entries[name]
    if info.error is not None:
        raise PluginError(
            f"{kind} {name!r} ({info.package} {info.version}) cannot be used: {info.error}"
        )
    return info, plugin


def get_strategy(
    name: str,
    *,
    addons: Sequence[Any] = (),
    axis_names: Mapping[str, str] | None = None,
    **options: Any,
) -> Strategy:
    """The strategy called ``name``, configured with ``options``, wrapped by ``addons``
    (installed add-ons' names, or add-on plugin objects).

    Example, two installed parallelisms composed, an option given to one of them::

        get_strategy("a+b", **{"b.min_size": 0})

    ``name`` is an installed strategy, a parallelism, or parallelisms joined by ``+``
    (:mod:`shardplug.core.compose`). In a composition an option ``KEY`` goes to every
    parallelism that takes it, ``PART.KEY`` to that one only; an add-on's option is always
    ``ADDON.KEY`` (``get_strategy("fsdp", addons=["offload"], **{"offload.params": True})``).
    ``axis_names`` renames a composition's mesh axes (``{ROLE: NAME}``) to the names the
    model uses.

    Raises :class:`UnknownStrategyError` (listing the available names) for an unknown name,
    :class:`StrategyOptionError` for an option it does not take, :class:`CompositionError`
    for parallelisms that do not compose, and :class:`PluginError` when the plugin under
    that name could not be loaded.
    """
    name, named_addons = split_addons(name)
    addons = [*addons, *named_addons]
    labels = [a if isinstance(a, str) else type(a).__name__ for a in addons]
    twice = sorted({a for a in labels if labels.count(a) > 1})
    if twice:
        raise CompositionError(f"add-on {twice[0]!r} is given twice: name it once")
    extra = []
    for addon in addons:
        if not isinstance(addon, str):  # a plugin object, made by its author's code
            extra.append((_given(addon), addon))
            continue
        addon_info, addon_plugin = _lookup(ADDON_GROUP, addon, "add-on")
        mine = {k.partition(".")[2]: options[k] for k in options if k.startswith(f"{addon}.")}
        extra.append((addon_info, _instantiate(addon_info, addon_plugin, mine, "add-on")))
    named = {a for a in addons if isinstance(a, str)}
    options = {k: v for k, v in options.items() if k.partition(".")[0] not in named}
    names = compose.parse(name)
    if len(names) == 1:
        info, plugin = _lookup(GROUP, name, "strategy")
        if info.kind == "strategy":
            if axis_names:
                raise CompositionError(
                    f"strategy {name!r} lays out its own mesh: axis_names (--axis-name) "
                    f"renames the axes of parallelisms only"
                )
            return Strategy(info, _instantiate(info, plugin, options), extra)
    return _composition(name, names, options, dict(axis_names or {}), extra)


def strategy_options(name: str) -> tuple[StrategyOption, ...]:
    """The options ``name`` takes (a strategy, a parallelism, or a composition's ``KEY`` and
    ``PART.KEY``; an add-on named in it, ``ADDON.KEY``), read from the plugins' signatures
    without making the strategy."""
    name, addons = split_addons(name)
    extra = tuple(
        dataclasses.replace(o, name=f"{addon}.{o.name}")
        for addon in addons for o in addon_options(addon)
    )  # fmt: skip
    names = compose.parse(name)
    if len(names) == 1:
        info, _ = _lookup(GROUP, name, "strategy")
        if info.kind != "composition":
            return (*info.options, *extra)
    return (*_composed_options(_expand(names)), *extra)


def split_addons(name: str) -> tuple[str, list[str]]:
    """``"fsdp+offload"`` into ``("fsdp", ["offload"])``: an installed add-on named among the
    parallelisms (and not itself a strategy) wraps the rest, as ``--addon`` does."""
    names = compose.parse(name)
    strategies, addons = _entries(GROUP), _entries(ADDON_GROUP)
    named = [n for n in names if n in addons and n not in strategies]
    rest = [n for n in names if n not in named]
    if named and not rest:
        raise CompositionError(
            f"{name!r} names add-ons only ({', '.join(named)}): an add-on wraps a strategy, "
            f"as in STRATEGY+{named[0]}"
        )
    return ("+".join(rest), named) if named else (name, [])


def plain_strategy() -> str:
    """The name of the plainest installed strategy: the parallelism whose one hook is its
    axis, and that axis splits the batch (every device holds the whole model and a slice of
    the batch: data parallelism), found by what it does, never by its name; a built-in's
    before a third party's. It is the default strategy, and the reference a conformance
    suite and ``bench`` compare with.

    :raises PluginError: no installed strategy is one (the built-ins not installed).
    """
    for info in list_strategies():
        if info.kind != "parallelism" or info.hooks != ("parallel_axis",):
            continue
        _, plugin = _lookup(GROUP, info.name, "strategy")
        try:
            axis = _instantiate(info, plugin, {}).parallel_axis()
        except ShardplugError:
            continue
        if getattr(axis, "batch", False):
            return info.name
    raise PluginError(
        "no installed strategy splits the batch alone (data parallelism, one of shardplug's "
        "built-ins): reinstall shardplug"
    )


def resolve_strategy(strategy: str | Strategy | None,
                     axis_names: Mapping[str, str] | None) -> Strategy:  # fmt: skip
    """A strategy given by name (with ``axis_names``), already made (by :func:`get_strategy`,
    which takes the axis names itself), or None: the plainest (:func:`plain_strategy`)."""
    if strategy is None:
        strategy = plain_strategy()
    if isinstance(strategy, str):
        return get_strategy(strategy, axis_names=axis_names)
    if not isinstance(strategy, Strategy):
        raise ConfigError(
            f"strategy={strategy!r}: give a strategy's name (shardplug strategies lists them; "
            "parallelisms joined by +) or the Strategy shardplug.get_strategy(name) returns"
        )
    if axis_names:
        raise ConfigError(
            "axis_names goes with a strategy name; for a Strategy object pass it to "
            "get_strategy(name, axis_names=...)"
        )
    return strategy


def _expand(names: Sequence[str]) -> list[tuple[StrategyInfo, Any]]:
    """Each name's plugin, a composition's name replaced by its parallelisms."""
    found = []
    for part in names:
        info, plugin = _lookup(GROUP, part, "parallelism")
        if info.kind == "composition":
            found.extend(_expand(compose.parse(info.parts or "")))
        else:
            found.append((info, plugin))
    return found


def _composition(
    label: str,
    names: Sequence[str],
    options: Mapping[str, Any],
    renames: dict[str, str],
    addons: Sequence[tuple[StrategyInfo, Any]],
) -> Strategy:
    infos = _expand(names)
    seen = [info.name for info, _ in infos]
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if repeated:
        raise CompositionError(f"composition {label!r} names {repeated[0]!r} twice")
    for info, _ in infos:
        if info.kind != "parallelism":
            raise CompositionError(
                f"{info.name!r} is a whole strategy (it lays out the mesh itself) and does not "
                f"compose: run it alone, or compose parallelisms "
                f"({', '.join(i.name for i in list_strategies() if i.kind == 'parallelism')})"
            )
    per: dict[str, dict[str, Any]] = {info.name: {} for info, _ in infos}
    takes = {info.name: {o.name for o in info.options} for info, _ in infos}
    for key, value in options.items():
        part, dot, option = key.partition(".")
        if dot:
            if part not in per:
                hint = (f": an option of the add-on {part!r}, given with addons=[{part!r}]"
                        if part in _entries(ADDON_GROUP) else "")  # fmt: skip
                raise StrategyOptionError(
                    f"option {key!r} names {part!r}, which is not a parallelism of {label!r} "
                    f"({', '.join(per)}){hint}"
                )
            per[part][option] = value
            continue
        takers = [part for part in per if key in takes[part]]
        if not takers:
            listed = ", ".join(
                o if len(per) == 1 else f"{p}.{o}" for p in per for o in sorted(takes[p])
            )
            listed = listed or "none"
            raise StrategyOptionError(
                f"strategy {label!r} has no option {key!r}; its options: {listed}"
            )
        for part in takers:
            per[part][key] = value
    pm = fallbacks.new_manager()  # the run's one manager: the parts, then the rest
    parts = [
        compose.make_part(info.name, _instantiate(info, plugin, per[info.name]), renames, pm)
        for info, plugin in infos
    ]
    roles = {p.axis.name for p in parts}
    unknown = sorted(set(renames.values()) - roles)
    if unknown:
        raise MeshError(
            f"axis_names {renames} renames axes that {label!r} does not have "
            f"(its axes: {', '.join(sorted(roles))}): rename one of those"
        )
    composition = compose.CompositionPlugin(parts)
    first = _entries(GROUP).get(label, (None,))[0]
    info = StrategyInfo(
        label,
        first.description if first is not None else " + ".join(i.name for i, _ in infos),
        BUILTIN_PACKAGE
        if all(i.builtin for i, _ in infos)
        else ", ".join(sorted({i.source for i, _ in infos if not i.builtin})),
        "",
        _composed_options(infos),
        tuple(sorted({h for i, _ in infos for h in i.hooks})),
        kind="composition" if len(infos) > 1 else "parallelism",
        parts="+".join(i.name for i, _ in infos),
    )
    return Strategy(info, composition, addons, parts=[(p.name, p.plugin) for p in parts], pm=pm)


def _composed_options(infos: Sequence[tuple[StrategyInfo, Any]]) -> tuple[StrategyOption, ...]:
    """Every option of the parallelisms, as ``KEY`` (to each that takes it) and ``PART.KEY``."""
    plain: dict[str, StrategyOption] = {}
    qualified = []
    for info, _ in infos:
        for option in info.options:
            plain.setdefault(option.name, option)
            if len(infos) > 1:
                qualified.append(dataclasses.replace(option, name=f"{info.name}.{option.name}"))
    return (*plain.values(), *qualified)


def _instantiate(
    info: StrategyInfo, plugin: Any, options: Mapping[str, Any], kind: str = "strategy"
) -> Any:
    accepted = {o.name for o in info.options}
    unknown = sorted(set(options) - accepted)
    if unknown:
        takes = ", ".join(f"{o.name} (default {o.default!r})" for o in info.options) or "none"
        raise StrategyOptionError(
            f"{kind} {info.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {takes}"
        )
    if not inspect.isclass(plugin):
        return plugin
    try:
        return plugin(**options)
    except ShardplugError:
        raise
    except (TypeError, ValueError) as exc:
        raise StrategyOptionError(f"{kind} {info.name!r}: bad option: {exc}") from None


def _given(addon: Any) -> StrategyInfo:
    """What the registry knows of an add-on given as an object: its class's name, its
    description, its hooks (refused in one line if they do not fit the specs)."""
    name = type(addon).__name__ if not inspect.isclass(addon) else addon.__name__
    if inspect.isclass(addon):
        raise PluginError(f"add-on {name!r}: give an instance ({name}()), not the class")
    try:
        hooks = _hooks(addon)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"add-on {name!r} does not fit the hook specs: {exc}") from None
    if "parallel_axis" in hooks:
        raise PluginError(
            f"add-on {name!r} declares parallel_axis: a parallelism composes by name "
            f"(installed under the entry-point group shardplug), it is not an add-on"
        )
    return StrategyInfo(name, _describe(addon), type(addon).__module__, "", (), hooks)


def addon_options(name: str) -> tuple[StrategyOption, ...]:
    """The options add-on ``name`` takes (given as ``ADDON.KEY``), read from its signature."""
    return _lookup(ADDON_GROUP, name, "add-on")[0].options
