"""What runs a training job and saves it, beside the step: checkpoints, data, the optimizer,
processes and hosts.

``checkpoint`` (Orbax checkpoints onto any strategy; ``checkpoint_checks``: fingerprints,
readability, the arrays compared), ``data`` (``Batches``: host data as the step's global
arrays), ``optim`` (``Optimizer``: the knobs, built by optax), ``launch`` (the local
launcher: restarts, lost hosts), ``distributed`` (``jax.distributed``, joined and watched),
``native`` (the runtime's C++ lines in shardplug's words), ``orbax_noise``, ``export``
(``.npz`` export and loading), ``waiting`` (a slow wait said in one line). The host-side
loop that calls them is ``loop/``.

May import: ``core``; never ``loop`` (which calls it), ``cli``, ``planning`` or a
strategy's own module.
"""

from __future__ import annotations

from types import ModuleType

from shardplug._lazy import submodule


def __getattr__(name: str) -> ModuleType:
    """Submodules on first use (PEP 562)."""
    return submodule(__name__, name)
