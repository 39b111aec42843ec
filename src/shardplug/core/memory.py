"""Where the training state lives: the devices' memory or the host's (offload).

A plugin says so once, at set-up (the ``place_state`` hook: each state array's
``NamedSharding`` with its memory kind); core keeps the arrays there between steps and
checkpoints them from there. Inside the step an array kept off the devices is brought to
them where it is used (:func:`on_devices`) and its new value goes back through the compiled
step's output shardings. :func:`argument_bytes` reads from a compiled program how many of
its argument bytes each device holds in its own memory and how many the host holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardplug.core.compiled.hlo import _BYTES
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ConfigError, PluginError

DEVICE = "device"


def check_program(jaxpr: Any, state_shardings: list[Any], batch_leaves: int, who: str,
                  paths: list[str]) -> None:  # fmt: skip
    """Refuse, in one line, a step program (a strategy's ``compile_step``, the first jit
    inside ``jaxpr``, which takes the state's ``state_shardings`` and the batch) that takes
    or returns a state array in another memory than the state lives in: it would move the
    state there and back every step, undoing ``place_state``."""
    want = [getattr(s, "memory_kind", None) or DEVICE for s in state_shardings]
    if all(k == DEVICE for k in want):
        return
    inner = next((e for e in getattr(jaxpr, "jaxpr", jaxpr).eqns
                  if e.primitive.name in ("pjit", "jit")
                  and len(e.params.get("in_shardings", ())) == len(want) + batch_leaves),
                 None)  # fmt: skip
    if inner is None:
        return
    for what, given in (("takes", inner.params["in_shardings"][: len(want)]),
                        ("returns", inner.params["out_shardings"][: len(want)])):  # fmt: skip
        for k, (kind, s) in enumerate(zip(want, given, strict=False)):
            have = getattr(s, "memory_kind", None)
            if have is not None and have != kind:
                raise PluginError(
                    f"{who}: compile_step's program {what} the state's {paths[k]} in memory "
                    f"{have!r}, and place_state keeps it in {kind!r}: give its jit the "
                    f"state_shardings it was given, memory kinds and all"
                )


def off_devices(sharding: Any) -> bool:
    """Whether an array of ``sharding`` lives outside its devices' own memory."""
    kind = getattr(sharding, "memory_kind", None)
    return kind is not None and kind != DEVICE


def on_device_shardings(shardings: Any) -> Any:
    """``shardings`` with every memory kind the devices' own (the layouts unchanged)."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(DEVICE) if off_devices(s) else s,
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )


def any_off(shardings: Any) -> bool:
    """Whether any array of ``shardings`` lives off its devices."""
    return any(off_devices(s) for s in jax.tree.leaves(shardings))


def on_devices(tree: Any, shardings: Any) -> Any:
    """Inside a traced program: the arrays of ``tree`` that ``shardings`` keeps off the
    devices, brought to them (``jax.device_put`` to device memory, which the compiler makes
    a copy from the host); the others as they are."""
    if shardings is None or not any_off(shardings):
        return tree
    return jax.tree.map(
        lambda x, s: jax.device_put(x, jax.memory.Space.Device) if off_devices(s) else x,
        tree,
        shardings,
    )


def abstract_for(shardings: Any, mesh: Any) -> Any:
    """``shardings`` as ``place_state`` is given them: on ``mesh``, or on its abstract mesh
    where its devices are compile-only (``explain --target``'s GPUs not present), whose
    shardings JAX lets keep a host memory kind (a compile-only device has no memories, and
    a ``NamedSharding`` on it drops the kind)."""
    from shardplug.core.devices import is_compile_only

    if not is_compile_only(mesh.devices.flat[0]):
        return shardings
    return jax.tree.map(lambda s: NamedSharding(mesh.abstract_mesh, s.spec), shardings,
                        is_leaf=lambda s: isinstance(s, NamedSharding))  # fmt: skip


def concrete(placed: Any, mesh: Any) -> Any:
    """What ``place_state`` chose, on ``mesh`` again except where an array lives off the
    devices of a compile-only mesh (:func:`abstract_for`): JAX compiles a program whose
    host arguments are laid out on the abstract mesh, its devices taken from the rest."""
    return jax.tree.map(
        lambda s: s if off_devices(s) or s.mesh is mesh else NamedSharding(mesh, s.spec),
        placed, is_leaf=lambda s: isinstance(s, NamedSharding),
    )  # fmt: skip


def checked(placed: Any, laid_out: Any, who: str) -> Any:
    """``placed`` (what ``place_state`` returned) checked against the state's layout
    ``laid_out``: the same tree, each array split as laid out (a memory kind the devices
    lack, JAX's ``NamedSharding`` refuses itself)."""
    got, structure = jax.tree.flatten(placed, is_leaf=lambda s: isinstance(s, NamedSharding))
    if structure != jax.tree.structure(laid_out):
        have = len(jax.tree.leaves(laid_out))
        what = (f"a tree of {len(got)} leaves where the state has {have}" if len(got) != have
                else f"a {type(placed).__name__}, not the TrainState it was given")  # fmt: skip
        raise PluginError(
            f"{who}: place_state returned {what}; return the shardings it was given, each "
            f"with its memory kind (jax.tree.map over them)"
        )
    for field in ("step", "rng"):
        if hasattr(placed, field) and off_devices(getattr(placed, field)):
            raise PluginError(
                f"{who}: place_state put the state's {field} in host memory: the step count "
                f"and the key stay on the devices (move params, opt_state or model_state)"
            )
    for path, old, new in zip(leaf_paths(laid_out), jax.tree.leaves(laid_out), got, strict=True):
        if not isinstance(new, NamedSharding):
            raise PluginError(
                f"{who}: place_state returned {new!r} for {path}; return a NamedSharding "
                f"(the one given, sharding.with_memory_kind(KIND))"
            )
        if new.spec != old.spec or new.mesh != old.mesh:
            raise PluginError(
                f"{who}: place_state changed how {path} is split ({old.spec} to {new.spec}): "
                f"it chooses the memory an array lives in; its layout is shard_params'"
            )
    return placed


_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")


def entry_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """The bytes of a compiled program's ``arguments`` and ``outputs`` on each device, by
    where they live: ``device`` (its own memory) and ``host`` (laid out in the host's memory
    space, ``S(5)``), read from the program's entry layout."""
    out = {k: {"device": 0, "host": 0} for k in ("arguments", "outputs")}
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        return out
    depth, end = 0, start + len("entry_computation_layout=")
    while end < len(hlo_text):  # to the brace that closes the layout
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        if depth == 0:
            break
        end += 1
    arguments, _, outputs = hlo_text[start:end].partition(")->")
    for key, text in (("arguments", arguments), ("outputs", outputs)):
        for dtype, dims, layout in _ARRAY.findall(text):
            size = math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
            out[key]["host" if layout and ":S(5)" in layout else "device"] += size
    return out


def argument_bytes(hlo_text: str) -> dict[str, int]:
    """The bytes of a compiled program's arguments on each device: ``device`` and ``host``
    (:func:`entry_bytes`)."""
    return entry_bytes(hlo_text)["arguments"]


def peak_bytes(analysis: Any, hlo_text: str | None = None) -> int | None:
    """A compiled program's peak per device in the device's own memory, from its
    ``memory_analysis()``: arguments + outputs - what the outputs reuse of donated arguments
    + temporaries. Where the backend counts arrays kept in host memory (offload's) among the
    device's, as XLA:CPU does, the program's entry layout (``hlo_text``) takes them out."""
    sizes = [
        getattr(analysis, f"{name}_size_in_bytes", None) for name in ("argument", "output", "temp")
    ]
    if None in sizes:
        return None
    alias = getattr(analysis, "alias_size_in_bytes", 0) or 0
    told = getattr(analysis, "host_argument_size_in_bytes", 0) or 0
    if hlo_text is not None and not told:
        host = entry_bytes(hlo_text)
        moved_in, moved_out = host["arguments"]["host"], host["outputs"]["host"]
        sizes[0] -= moved_in
        sizes[1] -= moved_out
        alias -= min(alias, moved_in, moved_out)  # donated host state is its own output
    return sizes[0] + sizes[1] - alias + sizes[2]


def on_devices_only(axis: Any) -> None:
    """Refuse host memory, in one line, inside a per-device program (``axis``, its batch
    axis, set): it takes its state on the devices."""
    if axis is not None:
        raise ConfigError(
            "a per-device program takes its state on the devices: it cannot keep arrays in "
            "host memory; use a strategy the compiler lays out, or keep the state on the devices"
        )


def brought(state: Any, placed: Any, axis: Any, *fields: str) -> Any:
    """``state`` (a TrainState) with the arrays of ``fields`` that ``placed`` (its shardings)
    keeps off the devices brought to them (:func:`on_devices`); refused in a per-device
    program (``axis``, its batch axis, set)."""
    if placed is None or not any(any_off(getattr(placed, f)) for f in fields):
        return state
    on_devices_only(axis)
    return state._replace(**{f: on_devices(getattr(state, f), getattr(placed, f)) for f in fields})


def _to(space: Any, tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def update_on_host(
    optimizer: Any,
    grads: Any,
    state: Any,
    given: Any,
    placed: Any,
    keep: Callable[[Any, Any], Any] | None,
) -> tuple[Any, Any]:
    """Inside a traced step: the optimizer's update computed in host memory, next to its
    state (``place_state`` keeps it there): the gradients copied to the host, the parameters
    too unless they live there (``given``: the state as the step received it, ``state`` with
    what was brought to the devices), the new parameters copied back where they live.
    ``keep(new, old)``: what a step that judges itself keeps (its verdict, on the host).

    :return: the new parameters and optimizer state."""
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    params_off = jax.tree.map(off_devices, placed.params)
    params = jax.tree.map(lambda x, kept, o: kept if o else jax.device_put(x, host),
                          state.params, given.params, params_off)  # fmt: skip

    def update(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        updates, new_state = optimizer.update(grads, opt_state, params)
        new = applied(params, updates)
        if keep is not None:
            new, new_state = keep((new, new_state), (params, opt_state))
        return new, new_state

    new, opt_state = on_host(update, _to(host, grads), state.opt_state, params)
    new = jax.tree.map(lambda x, o: x if o else jax.device_put(x, device), new, params_off)
    return new, opt_state


def on_host(f: Callable[..., Any], *args: Any) -> Any:
    """Inside a traced program: ``f(*args)`` computed by the host, in its memory, every
    result left there. JAX's ``compute_on`` wrapper; JAX up to 0.11.0 named it
    ``compute_on2``, its ``compute_on`` then a context manager that later JAX removed."""
    from jax.experimental import compute_on as api

    wrap = getattr(api, "compute_on2", api.compute_on)
    return wrap(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)


def leafwise(optimizer: Any, grads: Any, opt_state: Any, params: Any) -> list[int] | None:
    """Each optimizer-state leaf's parameter (its index among the parameters' leaves, -1 for
    state they share: a step count), where the update provably computes each parameter's
    update and state from that parameter's gradient, value and state and the shared state
    alone, and the shared state from itself; None where it does not (a global norm's
    clipping).

    The proof reads the traced update's data flow (every output of an operation taken to
    depend on all of its inputs: what it finds independent is)."""
    import optax

    count = len(jax.tree.leaves(params))
    index = jax.tree.unflatten(jax.tree.structure(params), list(range(count)))
    masked = optax.MaskedNode  # a parameter an optax.masked update leaves alone: no state
    labels = jax.tree.leaves(optax.tree_utils.tree_map_params(
        optimizer, lambda s, i: s if isinstance(s, masked) else i, opt_state, index,
        transform_non_params=lambda _: -1, is_leaf=lambda x: isinstance(x, masked),
    ))  # fmt: skip
    if len(labels) != len(jax.tree.leaves(opt_state)):
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (grads, opt_state,
                                                                             params))  # fmt: skip
    traced = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(*shapes)
    ins = [*range(count), *labels, *range(count)]  # grads, state, params
    upd, new = jax.tree.structure(grads).num_leaves, len(labels)
    outs = [*range(count), *labels][: upd + new]
    found = _depends(traced.jaxpr)
    for label, needs in zip(outs, found, strict=True):
        allowed = {-1} if label < 0 else {-1, label}
        if any(ins[k] not in allowed for k in needs):
            return None
    return labels


def _depends(jaxpr: Any) -> list[frozenset[int]]:
    """For each output of ``jaxpr``, the indices of the inputs it may depend on."""
    env: dict[Any, frozenset[int]] = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}

    def of(v: Any) -> frozenset[int]:
        try:
            return env.get(v, frozenset())
        except TypeError:  # a literal
            return frozenset()

    for eqn in jaxpr.eqns:
        inner = _called(eqn)
        if inner is not None:  # a call: each output needs what the callee's needs
            given = [of(v) for v in eqn.invars]
            for out, needs in zip(eqn.outvars, _depends(inner), strict=True):
                env[out] = frozenset().union(*(given[k] for k in needs))
            continue
        needs = frozenset().union(*(of(v) for v in eqn.invars))
        for out in eqn.outvars:
            env[out] = needs
    return [of(v) for v in jaxpr.outvars]


# Operations that call a program once on their operands, its results theirs: a nested
# jit (optax's jit(inline=True) helpers stay one since JAX 0.11), remat, custom derivatives.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")  # fmt: skip


def _called(eqn: Any) -> Any:
    """The program a call operation (:data:`_CALLS`) runs, its inputs and outputs the
    operation's; None for any other operation (a loop runs its body many times)."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = getattr(eqn.params.get(key), "jaxpr", eqn.params.get(key))
        if (hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars)
                and len(inner.outvars) == len(eqn.outvars)):  # fmt: skip
            return inner
    return None


def host_values(jaxpr: Any) -> list[Any]:
    """The abstract values a traced program computes into host memory, in it and every
    program nested in it (a loop's body once): what a remat policy that offloads moves (a
    layer stack's inputs, stacked by its scan, and each layer's on its way)."""
    host = jax.memory.Space.Host
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        found += [v.aval for v in eqn.outvars if getattr(v.aval, "memory_space", None) == host]
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    found += host_values(sub)
    return found


#: the operations whose programs save activations per layer: a layer stack's loop, remat
_SAVING = frozenset({"scan", "while", "checkpoint", "remat"})


def activations_on_host(jaxpr: Any) -> list[Any]:
    """:func:`host_values` a loop or a remat computes (and its outputs): the activations a
    remat policy that offloads moves, not the training state offload keeps on the host."""
    from shardplug.core.cache import subjaxprs

    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        subs = list(subjaxprs(eqn))
        if eqn.primitive.name in _SAVING:
            host = jax.memory.Space.Host
            found += [v.aval for v in eqn.outvars
                      if getattr(v.aval, "memory_space", None) == host]  # fmt: skip
            found += [v for sub in subs for v in host_values(sub)]
        else:
            found += [v for sub in subs for v in activations_on_host(sub)]
    return found


def update_in_pieces(
    optimizer: Any,
    grads: Any,
    params: Any,
    held: Any,
    labels: list[int],
    keep: Callable[[Any, Any], Any] | None,
    params_off: Any = None,
    state_off: list[bool] | None = None,
) -> tuple[Any, Any]:
    """Inside a traced step: the optimizer's update one parameter at a time, its state
    (``held``, kept in host memory) brought to the devices a parameter's leaves at a time and
    its new value sent back before the next parameter's are brought: the devices never hold
    more than one parameter's optimizer state. A parameter kept in host memory too
    (``params_off``: a tree of bools; ``params`` then as the step received them) comes and
    goes with its state; a state leaf kept on the devices (``state_off`` False) stays there.
    ``labels``: :func:`leafwise`'s. ``keep(new, old)``: what a step that judges itself
    keeps.

    :return: the new parameters and optimizer state, each where it lives."""
    import optax

    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    p_leaves, p_def = jax.tree.flatten(params)
    away = jax.tree.leaves(params_off) if params_off is not None else [False] * len(p_leaves)
    g_leaves = jax.tree.leaves(grads)
    s_leaves, s_def = jax.tree.flatten(held)
    count = len(p_leaves)
    index = jax.tree.unflatten(p_def, list(range(count)))
    positions = jax.tree.unflatten(s_def, list(range(len(s_leaves))))
    off = state_off if state_off is not None else [True] * len(s_leaves)
    shared = {k: jax.device_put(x, device) if off[k] else x for k, x in enumerate(s_leaves)
              if labels[k] < 0}  # fmt: skip
    new_params, new_state = list(p_leaves), list(s_leaves)
    sent: Any = None  # the previous parameter's new state, on its way back to the host

    def only(i: int, leaves: list[Any]) -> Any:
        return jax.tree.unflatten(p_def, [x if k == i else optax.MaskedNode()
                                          for k, x in enumerate(leaves)])  # fmt: skip

    for i in range(count):
        mine = [k for k, label in enumerate(labels) if label == i]
        moving = [k for k in mine if off[k]]  # the rest are on the devices already
        brought = ([s_leaves[k] for k in moving], p_leaves[i] if away[i] else None)
        # not before this parameter's gradient exists, nor before the last one's state has
        # left: the GPU's scheduler would otherwise bring it in early and hold it
        brought = jax.lax.optimization_barrier((brought, g_leaves[i], sent))[0]
        values = {**shared, **{k: s_leaves[k] for k in mine if not off[k]},
                  **dict(zip(moving, (jax.device_put(x, device) for x in brought[0]),
                             strict=True))}  # fmt: skip
        here = jax.device_put(brought[1], device) if away[i] else p_leaves[i]
        state = optax.tree_utils.tree_map_params(
            optimizer,
            lambda k, j, i=i: k if j == i and not isinstance(k, optax.MaskedNode)
            else optax.MaskedNode(),
            positions, index, transform_non_params=lambda k: k,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )  # fmt: skip
        present = jax.tree.leaves(state)  # the state leaves this piece reads, in tree order
        before = state = jax.tree.map(lambda k, values=values: values[k], state)
        param = only(i, [here if k == i else x for k, x in enumerate(p_leaves)])
        updates, state = optimizer.update(only(i, g_leaves), state, param)
        new = applied(param, updates)
        if keep is not None:
            new, state = keep((new, state), (param, before))
        new_params[i] = jax.tree.leaves(new)[0]
        if away[i]:
            new_params[i] = jax.device_put(new_params[i], host)
        done = dict(zip(present, jax.tree.leaves(state), strict=True))
        sent = [jax.device_put(done[k], host) for k in moving]
        for k in mine:
            new_state[k] = done[k]
        for k, x in zip(moving, sent, strict=True):
            new_state[k] = x
        sent += [new_params[i]] if away[i] else []
        for k in shared:  # every piece computes the same: the last one's is kept
            new_state[k] = done[k]
    return jax.tree.unflatten(p_def, new_params), jax.tree.unflatten(s_def, new_state)


def applied(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, an integer parameter (a quantized frozen base's) kept as it
    is: it has no gradient, and 4-bit integers take no arithmetic with floats."""
    import jax.numpy as jnp

    def apply(p: Any, u: Any) -> Any:
        if p is None or not jnp.issubdtype(p.dtype, jnp.inexact):
            return p
        return jnp.asarray(p + u).astype(p.dtype)

    return jax.tree.map(apply, params, updates, is_leaf=lambda x: x is None)
