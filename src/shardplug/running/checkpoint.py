"""Checkpoints: asynchronous, sharded, verified, and restorable onto any strategy or mesh.

A checkpoint is one Orbax checkpoint (``DIR/<step>/``) with two items:

- ``state``: every array of the training state (parameters, optimizer state, model state,
  step, random key), each device writing its own shards, in the background;
- ``meta``: JSON: the name, shape and dtype of every array, a fingerprint of each, the step,
  the data position, and the configuration the run was made with.

Orbax writes into a temporary directory and renames it when complete, so a checkpoint cut
short (a crash, SIGKILL) is never listed. The fingerprints, computed on the devices before
saving and again after restoring, catch a checkpoint whose files were damaged since. Nothing
in a checkpoint is unpickled or evaluated: the arrays are tensorstore data, the rest JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplug.core.sharding import path_str
from shardplug.errors import CheckpointError, ConfigError, ShardplugWarning
from shardplug.running.checkpoint_checks import (
    _check_frozen,
    _check_same_arrays,
    _check_writable,
    _Damaged,
    _is_key,
    _reason,
    fingerprints,
    readable,
)
from shardplug.running.orbax_noise import quiet_when_failing
from shardplug.running.waiting import announced

FORMAT = 1


def state_leaves(state: Any) -> tuple[list[str], list[Any], Any]:
    """Names (``params/blocks/0/mlp/kernel``), leaves and treedef of a training state."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [path_str(path) for path, _ in flat]
    if len(set(names)) != len(names):
        raise ConfigError("the training state has two leaves with the same path")
    return names, [leaf for _, leaf in flat], treedef


def describe(names: Sequence[str], leaves: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "dtype"[, "key"]}}``: what the checkpoint's JSON records of each."""
    out = {}
    for name, x in zip(names, leaves, strict=True):
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            impl = str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else None
            out[name] = {"shape": list(data.shape), "dtype": str(data.dtype), "key": impl}
        else:
            out[name] = {"shape": list(x.shape), "dtype": str(jnp.dtype(x.dtype))}
    return out


def _storable(x: jax.Array) -> jax.Array:
    return jax.random.key_data(x) if _is_key(x) else x


class Checkpoints:
    """The checkpoints in one directory: save asynchronously, restore the newest good one.

    :param directory: created if missing; must be writable unless ``read_only``.
    :param keep: how many checkpoints to keep (the oldest are deleted).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, read_only: bool = False):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep must be a positive integer, got {keep!r}")
        self.directory = Path(directory).absolute()
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        else:
            _check_writable(self.directory)
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=False,
                cleanup_tmp_directories=not read_only,
                enable_async_checkpointing=True,
            ),
        )

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(
        self, step: int, state: Any, meta: Mapping[str, Any], frozen: Collection[str] = ()
    ) -> Path:
        """Start writing ``state`` as checkpoint ``step``; returns before the files are written.

        The devices' arrays are copied to host memory first, so training may go on (and
        donate the state) at once. ``meta`` is stored as JSON with the names, shapes, dtypes
        and fingerprints of the arrays added. The arrays named in ``frozen`` (a frozen base's,
        under adapters) are not written, only their fingerprints: a restore takes them from
        the state it is given, and refuses one whose differ.
        """
        names, leaves, _ = state_leaves(state)
        prints = dict(zip(names, fingerprints(leaves), strict=True))
        kept = [(n, x) for n, x in zip(names, leaves, strict=True) if n not in frozen]
        names, leaves = [n for n, _ in kept], [x for _, x in kept]
        record = {
            "format": FORMAT,
            "step": int(step),
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(),
            **meta,
            "arrays": describe(names, leaves),
            "fingerprints": {n: prints[n] for n in names},
        }
        if frozen:
            record["frozen"] = {n: prints[n] for n in prints if n in frozen}
        arrays = [_storable(x) for x in leaves]
        ocp = self._ocp
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(record)
            ),
            force=True,
        )
        return self.path(step)

    def wait(self) -> None:
        """Block until every save started has been written and committed (announced when it
        takes longer than :data:`shardplug.running.waiting.NOTICE_S`: a slow or hung disk)."""
        with announced(f"the checkpoint write in {self.directory}"):
            self._manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON of checkpoint ``step``; :class:`CheckpointError` if it is unreadable."""
        try:
            restored = self._manager.restore(
                step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore())
            )
            meta = restored.meta
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.path(step)} is damaged: its metadata cannot be read "
                f"({_reason(exc)})"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {self.path(step)} is not a shardplug checkpoint of format {FORMAT}"
            )
        return meta

    def restore(
        self, like: Any, shardings: Any, *, step: int | None = None, quarantine: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """The newest good checkpoint (or ``step``), read into ``shardings``.

        :param like: a state of the same structure (arrays or ``jax.ShapeDtypeStruct``); the
            checkpoint's arrays must have its names, shapes and dtypes. For a checkpoint
            saved with ``frozen`` arrays, ``like`` holds them (arrays): they are taken from it,
            their fingerprints compared with the saved ones.
        :param shardings: a ``NamedSharding`` per leaf of ``like``: each device reads only its
            own shards, whatever strategy, device count or mesh saved them.
        :param quarantine: rename a damaged checkpoint to ``<step>.damaged`` so that a run
            continuing from an older one can save that step again.
        :return: the state and the checkpoint's JSON.

        A damaged checkpoint (unreadable, or arrays that differ from their fingerprints) is
        reported in a :class:`ShardplugWarning` naming its path, and the previous one is
        tried; :class:`CheckpointError` when none is left. A checkpoint of another model or
        optimizer raises :class:`CheckpointError` naming the arrays that differ.
        """
        candidates = self._candidates(step)
        problems = []
        for candidate in candidates:
            try:
                return self._restore(candidate, like, shardings)
            except _Damaged as exc:
                problems.append(str(exc))
                moved = self._quarantine(candidate) if quarantine else None
                older = [c for c in candidates if c < candidate]
                warnings.warn(
                    f"{exc}"
                    + (f"; moved it to {moved}" if moved else "")
                    + (f"; trying step {older[0]}" if older else "; no older checkpoint"),
                    ShardplugWarning,
                    stacklevel=2,
                )
        raise CheckpointError(f"no good checkpoint in {self.directory}: {'; '.join(problems)}")

    def _candidates(self, step: int | None) -> list[int]:
        """``[step]``, or every complete checkpoint newest first; an error naming what there
        is when there is nothing to read."""
        available = self.steps()
        if not available:
            raise CheckpointError(
                f"no checkpoint in {self.directory}: it is empty or holds no complete checkpoint"
            )
        if step is not None and step not in available:
            raise CheckpointError(
                f"no checkpoint of step {step} in {self.directory}; it has steps "
                f"{', '.join(map(str, available))}"
            )
        return [step] if step is not None else available[::-1]

    def _read(
        self, step: int, meta: Mapping[str, Any], names: list[str], shardings: list[Any],
        only: set[str] | None = None,
    ) -> list[jax.Array]:  # fmt: skip
        """The arrays ``names`` of checkpoint ``step``, each in its sharding, checked against
        their fingerprints; :class:`_Damaged` if they cannot be read or differ. With ``only``,
        the others are skipped (Orbax's placeholder: not read at all) and left out."""
        ocp = self._ocp
        abstract = [
            jax.ShapeDtypeStruct(
                tuple(meta["arrays"][n]["shape"]), jnp.dtype(meta["arrays"][n]["dtype"]),
                sharding=s,
            ) if only is None or n in only else ocp.PLACEHOLDER
            for n, s in zip(names, shardings, strict=True)
        ]  # fmt: skip
        try:
            with quiet_when_failing(), announced(f"the checkpoint read of {self.path(step)}"):
                if only is None:
                    how = ocp.args.StandardRestore(abstract)
                else:  # placeholders, which only the PyTree handler skips
                    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
                    how = ocp.args.PyTreeRestore(abstract, restore_args=restore_args)
                restored = self._manager.restore(step, args=ocp.args.Composite(state=how))
            arrays = list(restored.state)
        except Exception as exc:
            raise _Damaged(
                f"checkpoint {self.path(step)} is damaged: its arrays cannot be read "
                f"({_reason(exc)})"
            ) from None
        if only is not None:
            kept = [(n, a) for n, a in zip(names, arrays, strict=True) if n in only]
            names, arrays = [n for n, _ in kept], [a for _, a in kept]
        saved = meta.get("fingerprints", {})
        found = fingerprints(arrays)
        wrong = [n for n, f in zip(names, found, strict=True) if saved.get(n) != f]
        if wrong:
            raise _Damaged(
                f"checkpoint {self.path(step)} is damaged: {len(wrong)} array(s) differ from "
                f"what was saved ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''})"
            )
        return arrays

    def _restore(self, step: int, like: Any, shardings: Any) -> tuple[Any, dict[str, Any]]:
        readable(self.path(step))  # trouble, not damage: stop before anything is moved
        try:
            meta = self.read_meta(step)
        except CheckpointError as exc:
            raise _Damaged(str(exc)) from None
        names, leaves, treedef = state_leaves(like)
        expected = describe(names, leaves)
        frozen = meta.get("frozen", {})
        read = [n for n in names if n not in frozen]
        _check_same_arrays(self.path(step), meta.get("arrays", {}),
                           {n: expected[n] for n in read})  # fmt: skip
        if frozen:
            _check_frozen(self.path(step), frozen, dict(zip(names, leaves, strict=True)))
        where = dict(zip(names, jax.tree.leaves(shardings), strict=True))
        arrays = dict(zip(read, self._read(step, meta, read, [where[n] for n in read]),
                          strict=True))  # fmt: skip
        out = [
            jax.device_put(leaf, where[n]) if n in frozen
            else jax.random.wrap_key_data(arrays[n], impl=expected[n]["key"])
            if "key" in expected[n] else arrays[n]
            for n, leaf in zip(names, leaves, strict=True)
        ]  # fmt: skip
        return jax.tree.unflatten(treedef, out), meta

    def _quarantine(self, step: int) -> Path | None:
        if jax.process_index() != 0:  # one process renames; every process skips the step
            return None
        target = self.directory / f"{step}.damaged"
        suffix = 1
        while target.exists():
            target = self.directory / f"{step}.damaged.{suffix}"
            suffix += 1
        try:
            self.path(step).rename(target)
        except OSError:
            return None
        self._manager.reload()
        return target

    def read_arrays(
        self, step: int | None = None, names: Sequence[str] | None = None
    ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
        """Checkpoint ``step`` (the newest for None) as host NumPy arrays, for export: its
        step, its arrays by name (PRNG keys left out; with ``names``, only those, the others
        not read at all) and its JSON.

        Read on the first device, whatever saved them; verified against the fingerprints.
        """
        step = self._candidates(step)[0]
        meta = self.read_meta(step)
        every = list(meta["arrays"])
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        only = None if names is None else set(names)
        try:
            arrays = self._read(step, meta, every, [device] * len(every), only)
        except _Damaged as exc:
            raise CheckpointError(str(exc)) from None
        read = every if only is None else [n for n in every if n in only]
        found = {
            n: np.asarray(a)
            for n, a in zip(read, arrays, strict=True)
            if "key" not in meta["arrays"][n]
        }
        return step, found, meta

    def read_meta_of(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """``(step, its JSON)`` of checkpoint ``step`` (the newest for None)."""
        step = self._candidates(step)[0]
        return step, self.read_meta(step)


def complete_steps(directory: Path) -> list[int]:
    """The complete checkpoints' steps in ``directory``, of either tier: Orbax commits one by
    renaming its temporary directory to the step number; the frequent tier's folders hold
    every process's shards between them."""
    from shardplug.running.local_layout import complete_local_steps, is_local

    if not directory.is_dir():
        return []
    if is_local(directory):
        return complete_local_steps(directory)
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _record(directory: Path, step: int) -> Any:
    """Checkpoint ``step``'s JSON, of either tier (raises OSError or ValueError)."""
    from shardplug.running.local_layout import is_local, local_record

    if is_local(directory):
        return local_record(directory, step)
    with open(directory / str(step) / "meta" / "metadata") as f:
        return json.load(f)


def saved_config(directory: Path, step: int) -> dict[str, Any]:
    """The configuration in the newest checkpoint's JSON (best effort: a damaged one is
    reported by the restore, which falls back to an older checkpoint)."""
    try:
        config = _record(directory, step).get("config", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return config if isinstance(config, dict) else {}


def saved_layout(directory: Path, step: int) -> dict[str, Any]:
    """What the newest checkpoint's run ran on: ``{"devices", "mesh", "strategy"}`` as its
    JSON holds them (best effort, as :func:`saved_config`)."""
    try:
        meta = _record(directory, step)
    except (OSError, ValueError):
        return {}
    if not isinstance(meta, dict):
        return {}
    return {k: meta[k] for k in ("devices", "mesh", "strategy") if k in meta}
