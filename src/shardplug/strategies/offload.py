"""The ``offload`` add-on: the optimizer state (and optionally the parameters) in host memory
between steps, so a device holds only what the step is computing with.

A full fine-tune in bfloat16 compute with float32 master weights and AdamW keeps 16 bytes a
parameter, 8 of them Adam's two moments: those are read once a step, by the update, and
nothing else needs them on the devices. ``offload`` says so through the ``place_state``
hook (it is an add-on, not a parallelism: it owns no mesh axis and changes no layout, so it
goes with any strategy or composition, ``--addon offload``), and core does the rest: each
array is laid out as the strategy lays it out, but in the host's pinned memory
(``pinned_host``); inside the step the optimizer state is copied to the devices for the
update, after the backward pass, one parameter's at a time where the update treats each
parameter alone (the devices hold one parameter's state at most), and its new value copied
back. With ``params`` the float32 master parameters live on the host too, copied in for the
forward pass and again, a parameter at a time, for the update; their gradients and the
activations stay on the devices. With ``update=host`` the update computes on the host
(ZeRO-Offload's way): the gradients go out, the new parameters come back, and the optimizer
state never reaches the devices.

The price is the copies: the optimizer state's bytes to the devices and back every step
(the parameters' too with ``params``), over PCIe on a GPU, or the host's arithmetic with
``update=host``. A per-device program (``pmap``) keeps its state on the devices and refuses
it.
"""

from __future__ import annotations

from typing import Any

import jax

from shardplug.plugin import StrategyOptionError, hookimpl

#: host memory a device reads and writes directly (JAX's memory kind)
HOST = "pinned_host"


class Offload:
    """Optimizer state (``opt_state``, default yes) and master parameters (``params``,
    default no) in pinned host memory between steps, copied to the devices where the step
    uses them; with ``update=host`` the update computes on the host, next to the optimizer
    state, which then never reaches the devices."""

    description = "optimizer state (and with params=true the parameters) in host memory"

    def __init__(self, opt_state: bool = True, params: bool = False, update: str = "device"):
        if update not in ("device", "host"):
            raise StrategyOptionError(
                f"offload option update must be device (the optimizer state copied in for "
                f"the update) or host (the update computed on the host), got {update!r}"
            )
        if update == "host" and not opt_state:
            raise StrategyOptionError(
                "offload's update=host computes the update next to the optimizer state in "
                "host memory: keep opt_state=true"
            )
        for name, value in (("opt_state", opt_state), ("params", params)):
            if not isinstance(value, bool):
                raise StrategyOptionError(
                    f"offload option {name} must be true or false, got {value!r}"
                )
        if not (opt_state or params):
            raise StrategyOptionError(
                "offload with opt_state=false and params=false moves nothing: leave the "
                "add-on out, or offload one of them"
            )
        self.opt_state, self.params, self.update = opt_state, params, update

    @hookimpl
    def update_memory(self) -> str:
        return self.update

    @hookimpl
    def place_state(self, shardings: Any) -> Any:
        def host(tree: Any) -> Any:
            return jax.tree.map(lambda s: s.with_memory_kind(HOST), tree)

        moved = {}
        if self.opt_state:
            moved["opt_state"] = host(shardings.opt_state)
        if self.params:
            moved["params"] = host(shardings.params)
        return shardings._replace(**moved)
