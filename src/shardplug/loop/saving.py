"""A run's checkpoints: its state saved with what resuming needs, and restored onto any layout.

:class:`RunCheckpoints` wraps the checkpoint store (``shardplug.running.checkpoint.Checkpoints``, or
anything with its ``save``, ``restore``, ``path`` and ``wait``) for one run: the loop saves
through it, and the trainer restores through it. Parameters that are not finite are never
saved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardplug.core import memory
from shardplug.errors import CheckpointError, NonFiniteError
from shardplug.loop import feed
from shardplug.loop.program import RunState


def run_meta(
    strategy: Any, mesh: Any, config: Any, program: Any, data: Any, run: RunState
) -> dict[str, Any]:
    """What a checkpoint stores beside the arrays: enough to resume onto any layout (the
    strategy and mesh that wrote it, the run's config, the batches' shapes, and where the
    data's next batch starts)."""
    from shardplug import __version__

    meta = {
        "skipped_steps": run.skipped, "strategy": strategy.name,
        "addons": list(strategy.addons), "devices": int(mesh.size),
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "shardplug": __version__, "config": config,
        "batch_shapes": feed.global_shapes(program.signature) if program else None,
    }  # fmt: skip
    if data is not None:  # where the next batch starts
        meta["data_state"] = data.state_at(run.step)
    return meta


def frozen_names(adapter: Any, state: Any) -> set[str]:
    """The checkpoint names of the parameters ``adapter`` keeps frozen (a LoRA run's base)."""
    mask = None if adapter is None else adapter.trainable(state.params)
    if mask is None:
        return set()
    from shardplug.running.checkpoint import state_leaves

    names = [n for n in state_leaves(state)[0] if n.startswith("params/")]
    return {n for n, t in zip(names, jax.tree.leaves(mask), strict=True) if not t}


class RunCheckpoints:
    """The checkpoints of one run (see the module).

    :param store: the checkpoint store of the run's directory.
    :param meta: what to store beside the arrays (the strategy, mesh, config, the data's
        state...), asked at each save for the run as it stands.
    """

    def __init__(self, store: Any, meta: Callable[[RunState], dict[str, Any]],
                 adapter: Any = None, local: Any = None):  # fmt: skip
        self.store = store
        self.meta = meta
        self.adapter = adapter  # the model's: its frozen parameters are not written
        self.local = local  # the frequent tier's store (fast local storage), or None
        self.saved_in: Any = store  # the store of the newest checkpoint saved or restored

    @classmethod
    def at(cls, settings: Any, meta: Callable[[RunState], dict[str, Any]],
           adapter: Any = None) -> RunCheckpoints | None:  # fmt: skip
        """The checkpoints of a run with these :class:`~shardplug.settings.Settings` (in its
        ``checkpoint_dir``, keeping ``keep``; the frequent tier in ``local_checkpoint_dir``,
        keeping the newest two), or None without a directory."""
        if settings.checkpoint_dir is None:
            return None
        from shardplug.running.checkpoint import Checkpoints
        from shardplug.running.local_checkpoint import LocalCheckpoints

        local = None
        if settings.local_checkpoint_dir is not None:
            local = LocalCheckpoints(settings.local_checkpoint_dir)
        return cls(Checkpoints(settings.checkpoint_dir, keep=settings.keep), meta, adapter,
                   local)  # fmt: skip

    @property
    def directory(self) -> Any:
        return self.store.directory

    def save(self, run: RunState, local: bool = False) -> str:
        """Checkpoint ``run``'s state now, in the background (into the frequent tier where
        ``local``); its path."""
        state = run.state()
        if not bool(_finite(state.params)):  # never save a broken model
            raise NonFiniteError.at(run.step - 1, self.last(run), "the parameters are")
        meta = {"data_position": run.step, **self.meta(run)}
        store = self.local if local and self.local is not None else self.store
        frozen = frozen_names(self.adapter, state)
        if frozen:  # a frozen base: its fingerprints alone (adapters' checkpoints stay small)
            path = store.save(run.step, state, meta, frozen=frozen)
        else:
            path = store.save(run.step, state, meta)
        run.saved_step, self.saved_in = run.step, store
        return str(path)

    def last(self, run: RunState) -> str | None:
        """The path of the newest checkpoint ``run`` saved or restored, if any."""
        return None if run.saved_step is None else str(self.saved_in.path(run.saved_step))

    def restore(
        self, like: Any, shardings: Any, step: int | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The newest good checkpoint's (or ``step``'s) state read into ``shardings``, and its
        JSON (a damaged one moved aside, the one before it used): the frequent tier's where
        it is newer than the persistent one's."""
        self.wait()
        local = self.local
        if local is not None and step is None:
            newest = (local.steps() or [-1])[-1]
            if newest > (self.store.steps() or [-1])[-1]:
                try:
                    found = local.restore(like, shardings, step=None, quarantine=True)
                except CheckpointError:  # none good in the fast tier: the persistent one
                    pass
                else:
                    self.saved_in = local
                    return found
        self.saved_in = self.store
        return self.store.restore(like, shardings, step=step, quarantine=True)

    def wait(self) -> None:
        self.store.wait()
        if self.local is not None:
            self.local.wait()

    def refuse_existing(self) -> None:
        """Refuse to start a run over another's checkpoints (restore() continues that run)."""
        from shardplug.running.checkpoint import complete_steps

        for directory, existing in [(self.store.directory, self.store.steps())] + (
            [] if self.local is None else
            [(self.local.directory, complete_steps(self.local.directory))]
        ):  # fmt: skip
            if existing:
                raise CheckpointError(
                    f"{directory} already holds checkpoints (newest: step {existing[-1]}): "
                    f"call restore() to continue that run, or choose an empty directory"
                )


def _finite(tree: Any) -> jax.Array:
    """Whether every array of ``tree`` is finite, each judged in the memory it lives in (an
    offloaded parameter on the host, never brought to the devices for it)."""
    leaves = jax.tree.leaves(tree)
    off = tuple(memory.off_devices(getattr(x, "sharding", None)) for x in leaves)
    return _all_finite(leaves, off)


@functools.partial(jax.jit, static_argnums=1)
def _all_finite(leaves: list[Any], off: tuple[bool, ...]) -> jax.Array:
    here = [x for x, o in zip(leaves, off, strict=True) if not o]
    there = [x for x, o in zip(leaves, off, strict=True) if o]
    ok = jnp.isfinite(optax.tree.norm(here))
    if there:
        def each(leaves: list[Any]) -> jax.Array:  # no constant of the devices' memory in it
            return functools.reduce(jnp.logical_and, [jnp.isfinite(x).all() for x in leaves])

        on_host = memory.on_host(each, there)
        ok = ok & jax.device_put(on_host, jax.memory.Space.Device)
    return ok
