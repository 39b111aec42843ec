"""One run's strategy: a pluggy manager holding core's fallbacks and the plugin (or a
composition of parallelisms), whose answers it checks; and the records it is made from, what
the registry (:mod:`shardplug.core.registry`) knows of an installed strategy and its
options."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import pluggy

from shardplug.core import compose, declared, fallbacks, memory
from shardplug.core.context import activation_rules, splitting_rows
from shardplug.core.mesh import retyped
from shardplug.core.sharding import check_batch, lay_out_hint, to_named
from shardplug.errors import (
    ConfigError,
    PluginError,
    ShardplugError,
    StrategyOptionError,
    one_line,
)

FALLBACKS = fallbacks.NAME
BUILTIN_PACKAGE = "shardplug"


@dataclasses.dataclass(frozen=True)
class StrategyOption:
    """One keyword a strategy accepts through ``get_strategy(name, **options)``."""

    name: str
    type: str
    default: Any

    def parse(self, text: str) -> Any:
        """The option's value from text (``-o KEY=VALUE``), typed by its annotation (of a
        union, the first of its plain types the text is: ``none``, bool, int, float, str)."""
        kind = self.type
        plain_text = kind == "str" or kind.startswith(("Sequence", "tuple"))
        if not text.strip() and not plain_text:  # -o cp.scheme= ran with the default
            raise StrategyOptionError(
                f"option {self.name}= has no value: give one, or leave the option out for its "
                "default"
            )
        if "|" in kind:
            kinds = [k.strip() for k in kind.split("|")]
            if "None" in kinds and text.lower() == "none":
                return None
            for plain in ("bool", "int", "float", "str"):
                if plain in kinds:
                    try:
                        return dataclasses.replace(self, type=plain).parse(text)
                    except StrategyOptionError:
                        continue
            raise StrategyOptionError(f"option {self.name}={text!r} is not a valid {kind}")
        try:
            if kind == "bool":
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                return text.lower() in ("true", "1")
            if kind in ("int", "float", "str"):
                return {"int": int, "float": float, "str": str}[kind](text)
            if kind.startswith(("Sequence", "tuple")):
                return tuple(part.strip() for part in text.split(",") if part.strip())
            return json.loads(text)
        except ValueError:
            raise StrategyOptionError(
                f"option {self.name}={text!r} is not a valid {kind}"
            ) from None


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """What the registry knows of one installed strategy (or add-on), before it is used."""

    name: str
    description: str
    package: str
    version: str
    options: tuple[StrategyOption, ...] = ()
    hooks: tuple[str, ...] = ()
    #: "parallelism" (composes with others on one mesh), "strategy" (runs alone) or
    #: "composition" (a name for parallelisms composed, declared with ``Composed``)
    kind: str = "strategy"
    #: for a composition, the parallelisms it composes (``"a+b"``)
    parts: str | None = None
    #: why it cannot be used (failed import, hooks that do not fit the specs, a name two
    #: packages claim), or None when it loaded.
    error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.package == BUILTIN_PACKAGE

    @property
    def source(self) -> str:
        return "built-in" if self.builtin else f"{self.package} {self.version}"


def _same_shapes(tree: Any, like: Any) -> bool:
    """Whether ``tree`` has ``like``'s structure and shapes (dtypes may differ)."""
    try:
        return jax.tree.structure(tree) == jax.tree.structure(like) and all(
            jnp.shape(a) == jnp.shape(b)
            for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(like), strict=True)
        )
    except (TypeError, ValueError):
        return False


class Strategy:
    """One run's strategy: a pluggy manager holding core's fallbacks and the named plugin.

    Its methods call the hooks with keyword arguments, check what comes back, and name the
    strategy and the hook in every error.
    """

    def __init__(
        self,
        info: StrategyInfo,
        plugin: Any,
        addons: Sequence[tuple[StrategyInfo, Any]] = (),
        parts: Sequence[tuple[str, Any]] = (),
        pm: pluggy.PluginManager | None = None,
    ):
        self.info = info
        self.plugin = plugin
        #: the configured plugin object of each parallelism (or of the whole strategy), by name
        self.parts: dict[str, Any] = dict(parts) if parts else {info.name: plugin}
        self.addons = tuple(addon_info.name for addon_info, _ in addons)
        #: the run's one plugin manager (a composition's parts are registered in it already)
        self.pm = pm if pm is not None else fallbacks.new_manager()
        # A composition's parallelisms answer the step hooks they implement; add-ons register
        # last, so their wrappers wrap whichever implementation answers.
        own = f"{info.name} (composition)" if parts else info.name
        named = [*parts, (own, plugin), *((i.name, a) for i, a in addons)]
        for name, obj in named:
            if self.pm.is_registered(obj):
                continue
            try:
                self.pm.register(obj, name=name)
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"{name!r} does not fit the hook specs: {exc}") from None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def unsupported(self) -> dict[str, str]:
        """What this strategy (or its parallelisms together) declares it cannot do, and why."""
        composition = self.composition
        if composition is not None:
            return composition.unsupported
        return declared.declared(self.plugin, "unsupported")

    @property
    def capabilities(self) -> dict[str, str]:
        """Capabilities beyond the built-in ones that its plugins declare, with their meaning."""
        plugins = [p.plugin for p in self.composition.parts] if self.composition else [self.plugin]
        found: dict[str, str] = {}
        for plugin in plugins:
            found.update(declared.declared(plugin, "capabilities"))
        return found

    @property
    def composition(self) -> compose.CompositionPlugin | None:
        """The parallelisms and their axes, when this strategy composes them."""
        return self.plugin if isinstance(self.plugin, compose.CompositionPlugin) else None

    def activation_rules(self) -> dict[str, tuple[str, ...]]:
        """Logical activation names -> mesh axes (empty for a whole strategy)."""
        return {} if self.composition is None else self.composition.activation_rules()

    def __repr__(self) -> str:
        addons = f", addons={list(self.addons)}" if self.addons else ""
        return f"Strategy({self.name!r}, {self.info.source}{addons})"

    def _call(self, hook: str, **kwargs: Any) -> Any:
        caller: Callable[..., Any] = getattr(self.pm.hook, hook)
        try:
            return caller(**kwargs)
        except ShardplugError:
            raise
        except Exception as exc:
            raise PluginError(
                f"strategy {self.name!r}: hook {hook} failed: {type(exc).__name__}: "
                f"{one_line(exc)}"
                f"{lay_out_hint(exc)}"
            ) from exc

    def make_mesh(
        self, devices: list[Any], mesh_shape: dict[str, int] | None, axis_types: str = "auto"
    ) -> Any:
        """The plugin's mesh, its axes of ``axis_types`` (``"auto"`` or ``"explicit"``:
        core retypes the mesh a plugin builds, so a plugin need not know the mode)."""
        from jax.sharding import Mesh

        if axis_types == "explicit":
            self.check_explicit()
        mesh = self._call("make_mesh", devices=devices, mesh_shape=mesh_shape)
        if not isinstance(mesh, Mesh):
            raise PluginError(f"strategy {self.name!r}: make_mesh returned {mesh!r}, not a Mesh")
        if sorted(d.id for d in mesh.devices.flat) != sorted(d.id for d in devices):
            raise PluginError(
                f"strategy {self.name!r}: make_mesh built a mesh over other devices "
                f"than the {len(devices)} it was given"
            )
        return retyped(mesh, axis_types)

    def check_explicit(self) -> None:
        """Refuse explicit axes where the strategy declares it cannot run on them."""
        reason = self.unsupported.get(declared.Capability.EXPLICIT_AXES)
        if reason is not None:
            raise ConfigError(
                f"strategy {self.name!r} does not run on explicit mesh axes: {reason}; use "
                f"axis_types='auto' (--axis-types auto) or another strategy"
            )

    def shard_params(self, params: Any, mesh: Any, annotations: Any | None) -> Any:
        specs = self._call("shard_params", params=params, mesh=mesh, annotations=annotations)
        return to_named(specs, mesh, plugin=self.name, hook="shard_params", like=params)

    def place_state(self, shardings: Any, state: Any, mesh: Any) -> Any:
        """The state's shardings with the memory each array lives in, as a plugin's
        ``place_state`` says (checked), or as given."""
        given = memory.abstract_for(shardings, mesh)
        placed = self._call("place_state", shardings=given, state=state, mesh=mesh)
        if placed is None:
            return shardings
        return memory.concrete(memory.checked(placed, given, f"strategy {self.name!r}"), mesh)

    def update_memory(self, shardings: Any, mesh: Any) -> str:
        """Where the optimizer's update computes (``device`` or ``host``), as a plugin's
        ``update_memory`` says (checked against ``shardings``, the state's), or ``device``."""
        where = self._call("update_memory", mesh=mesh)
        if where is None or where == "device":
            return "device"
        if where != "host":
            raise PluginError(
                f"strategy {self.name!r}: update_memory returned {where!r}; return 'device' "
                f"or 'host'"
            )
        if not all(memory.off_devices(s) for s in jax.tree.leaves(shardings.opt_state)):
            raise PluginError(
                f"strategy {self.name!r}: update_memory asks for the update on the host, and "
                f"some of the optimizer state lives on the devices: keep all of it in host "
                f"memory (place_state), or update on the devices"
            )
        return where

    def shard_batch(self, batch: Any, mesh: Any, sequences: tuple[int, ...] | None = None) -> Any:
        specs = self._call("shard_batch", batch=batch, mesh=mesh, sequences=sequences)
        shardings = to_named(specs, mesh, plugin=self.name, hook="shard_batch", like=batch)
        check_batch(batch, shardings)
        return shardings

    def shard_model_state(self, model_state: Any, mesh: Any) -> Any:
        specs = self._call("shard_model_state", model_state=model_state, mesh=mesh)
        return to_named(specs, mesh, plugin=self.name, hook="shard_model_state", like=model_state)

    def compute_grads(self, **kwargs: Any) -> Any:
        """A plugin's own gradient computation, checked, or None for core's."""
        owned = self._call("compute_grads", **kwargs)
        if owned is None:
            return None
        try:
            (loss, (metrics, _)), grads = owned
            fits = jnp.shape(loss) == () and isinstance(metrics, Mapping)
        except (TypeError, ValueError):
            fits = False
        if not (fits and _same_shapes(grads, kwargs["params"])):
            raise PluginError(
                f"strategy {self.name!r}: compute_grads must return ((loss, (metrics, "
                f"model_state)), grads): a scalar loss, a dict of metrics, and gradients "
                f"shaped like the parameters"
            )
        return owned

    def gather_params(self, params: Any, mesh: Any) -> Any:
        return self._call("gather_params", params=params, mesh=mesh)

    def held_weights(self, params: Any, mesh: Any, roles: Any = None) -> list[Any] | None:
        """Every plugin's ``held_weights`` answer, checked and merged: one ``Hold`` or None
        per leaf; None where no weight is held."""
        from shardplug.core.operations.held import Hold

        count = len(jax.tree.leaves(params))
        merged: list[Any] = [None] * count
        for answer in self._call("held_weights", params=params, mesh=mesh, roles=roles):
            if not isinstance(answer, list | tuple) or len(answer) != count or not all(
                    h is None or isinstance(h, Hold) for h in answer):  # fmt: skip
                raise PluginError(
                    f"strategy {self.name!r}: held_weights returned {type(answer).__name__}; "
                    f"return a list of {count} (one per parameter leaf) of "
                    f"shardplug.plugin.Hold or None"
                )
            for i, h in enumerate(answer):
                if h is not None and merged[i] is not None:
                    raise PluginError(
                        f"strategy {self.name!r}: {h.path} is held for both {merged[i].kind} "
                        f"and {h.kind}: a weight's products run one way; leave it to one"
                    )
                merged[i] = h if h is not None else merged[i]
        return merged if any(h is not None for h in merged) else None

    def gather_for_step(self, params: Any, mesh: Any) -> tuple[Any, dict[int, Any]]:
        """:meth:`gather_params` (through the hook, so an add-on that wraps it runs under a
        composition too), and (for a composition) the layer stacks' leaves of what it
        returned, which are gathered one layer at a time inside their scan instead."""
        gathered = self.gather_params(params, mesh)
        if self.composition is None:
            return gathered, {}
        return gathered, self.composition.layer_gathers(gathered, mesh)

    def contexts_while_tracing(self, mesh: Any) -> list[Any]:
        """The context managers entered around every traced program: the activation rules
        (:func:`shardplug.constrain`), the batch's row axes, and the parallelisms'
        operations (a composition's)."""
        rules = activation_rules(self.activation_rules())
        if self.composition is None:
            return [rules]
        rows = splitting_rows(self.composition.batch_axes)
        return [rules, rows, *self.composition.part_contexts(mesh)]

    def reduce_grads(self, grads: Any, mesh: Any) -> Any:
        return self._call("reduce_grads", grads=grads, mesh=mesh)

    @property
    def encodes_grads(self) -> bool:
        """Whether a plugin (the strategy or an add-on) implements ``encode_grads``."""
        return any(
            impl.plugin_name != FALLBACKS for impl in self.pm.hook.encode_grads.get_hookimpls()
        )

    def encode_grads(self, grads: Any, mesh: Any) -> Any:
        encoded = self._call("encode_grads", grads=grads, mesh=mesh)
        if not _same_shapes(encoded, grads):
            raise PluginError(
                f"strategy {self.name!r}: encode_grads must return the gradients' structure "
                f"and shapes (only the dtypes may change)"
            )
        return encoded

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
