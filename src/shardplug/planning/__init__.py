"""What plans a run: a step compiled and read before anything is allocated or trained.

``explain`` (with ``explain_memory``, ``explain_collectives`` and ``explain_time``: its
memory, its communication and its predicted time, each read off the compiled step) and
``views`` (how those are drawn and written); ``recommend`` (which strategy, by the policy
its docstring states; ``longest``: the longest sequence each fits); ``bench`` (strategies
side by side against hand-written JAX, run; ``bench_plan``: the same predicted for a GPU
that is not here). The one FLOP count and the units they print in are core's (``flops``,
``units``): the loop's metrics read them too.

May import: ``core``, ``loop``, ``running``, ``finetuning``, the facade (``trainer``,
``task``, ``settings``); never ``cli`` or a strategy's own module.
"""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (PEP 562)."""
    return submodule(__name__, name)
