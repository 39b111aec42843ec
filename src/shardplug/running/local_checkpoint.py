"""The frequent tier of checkpoints: each host's shards on its own fast storage, and a copy of
its predecessor's, so that a lost host loses nothing; a save blocks for the copy off the
devices alone.

Every process ``i`` of ``P`` writes, into ``DIR/p<i>/<step>/``, the shards its devices hold
(one replica of each: ``replica_id == 0``) and the shards of process ``i - 1``, which reach it
through one resharding onto the same devices rotated by one process (a collective-permute,
over the devices' links). The step's files are written by a thread that runs no collective:
the training thread copies the shards to host memory, hands them over and goes on. The files
are raw bytes with a JSON index (each shard's array, slice and CRC-32, computed by the writing
thread: a fingerprint on the devices, as the persistent tier's, would hold the copy up behind
it); nothing is unpickled. A step is complete when the folders seen hold every process's
shards between them.

A restore agrees, across the processes, on the newest complete step, takes each process's
shards from one holder (its own folder where it survives, else its successor's copy), and
lays every array out in the sharding asked for, one at a time: each process fills what it
holds into the array's bits, and one sum over the processes (of integers: each element is
written by exactly one) places them. Any count of processes and any mesh restore any step, as
the persistent tier does.

Orbax's emergency checkpointing keeps a peer's copy too, but restores onto the processes and
mesh that saved it; a shardplug resume goes onto fewer hosts and other meshes, hence this.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import threading
import time
import warnings
import zlib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardplug.errors import CheckpointError, ShardplugWarning
from shardplug.running.checkpoint import FORMAT, describe, state_leaves
from shardplug.running.checkpoint_checks import (
    _check_frozen,
    _check_same_arrays,
    _check_writable,
    _is_key,
    fingerprints,
)
from shardplug.running.local_layout import held, local_record, step_folders, steps_in
from shardplug.running.waiting import announced

KEEP = 2  # steps kept per folder: a step written by some processes and not others (a
# failure in the write) leaves the one before it whole in every folder
CHUNK = 1 << 29  # bytes per process copied at once: bounds the peer copy's transient

#: ``{origin process: [(array name, its slice of the array, the bytes)]}``
Pieces = dict[int, list[tuple[str, tuple[slice, ...], np.ndarray]]]


class LocalCheckpoints:
    """The frequent tier in ``directory`` (fast local storage: a RAM disk, a node's NVMe)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).absolute()
        _check_writable(self.directory)
        earlier = sorted(p.name for p in self.directory.iterdir() if p.name.isdigit())
        if earlier:
            raise CheckpointError(
                f"{self.directory} holds Orbax checkpoints (steps {', '.join(earlier)}) of "
                f"shardplug's earlier local tier: move them aside or choose another "
                f"--local-checkpoint-dir"
            )
        self.me, self.nprocs = jax.process_index(), jax.process_count()
        self.folder = self.directory / f"p{self.me}"
        self.folder.mkdir(exist_ok=True)
        for left in self.folder.glob("tmp-*"):  # a write cut short: never complete
            shutil.rmtree(left, ignore_errors=True)
        self._writer: threading.Thread | None = None
        self._failed: str | None = None
        #: the last write's seconds, on the clock and of the writing thread's CPU
        self.written: tuple[float, float] | None = None

    def path(self, step: int) -> Path:
        return self.folder / str(step)

    # saving

    def save(self, step: int, state: Any, meta: Mapping[str, Any],
             frozen: Collection[str] = ()) -> Path:  # fmt: skip
        """Copy ``state``'s shards (and the predecessor's) to host memory, then write them in
        the background; returns once the copy is done (training may donate the state)."""
        names, leaves, _ = state_leaves(state)
        record = {
            "format": FORMAT, "step": int(step),
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(), **meta,
            "arrays": describe([n for n in names if n not in frozen],
                               [x for n, x in zip(names, leaves, strict=True) if n not in frozen]),
        }  # fmt: skip
        if frozen:
            kept = [(n, x) for n, x in zip(names, leaves, strict=True) if n in frozen]
            prints = fingerprints([x for _, x in kept])
            record["frozen"] = {n: f for (n, _), f in zip(kept, prints, strict=True)}
        arrays = [(n, jax.random.key_data(x) if _is_key(x) else x)
                  for n, x in zip(names, leaves, strict=True) if n not in frozen]  # fmt: skip
        pieces = _copied(arrays, self.me, self.nprocs)
        self.wait()  # the write before this one, if it is still going
        self._writer = threading.Thread(
            target=self._write, args=(int(step), record, pieces), daemon=True,
            name="shardplug-local-checkpoint",
        )  # fmt: skip
        self._writer.start()
        return self.path(step)

    def _write(self, step: int, record: dict[str, Any], pieces: Pieces) -> None:
        began, cpu = time.perf_counter(), time.thread_time()
        try:
            temp = self.folder / f"tmp-{step}"
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir()
            index: dict[str, list[dict[str, Any]]] = {}
            for origin, held in pieces.items():
                entries, offset = [], 0
                with open(temp / f"{origin}.bin", "wb") as file:
                    for name, where, data in held:
                        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
                        file.write(view)
                        entries.append({
                            "name": name, "index": [[s.start, s.stop] for s in where],
                            "offset": offset, "nbytes": view.nbytes, "crc32": zlib.crc32(view),
                        })  # fmt: skip
                        offset += view.nbytes
                index[str(origin)] = entries
            record = {**record, "nprocs": self.nprocs, "writer": self.me, "origins": index}
            (temp / "index.json").write_text(json.dumps(record))
            for later in [s for s in steps_in(self.folder) if s >= step]:
                shutil.rmtree(self.path(later), ignore_errors=True)  # a run rolled back: theirs
            temp.rename(self.path(step))
            for old in steps_in(self.folder)[:-KEEP]:
                shutil.rmtree(self.path(old), ignore_errors=True)
            self.written = (time.perf_counter() - began, time.thread_time() - cpu)
        except Exception as exc:  # said by the next save or wait, in the training thread
            self._failed = f"{type(exc).__name__}: {exc}"

    def wait(self) -> None:
        """Block until the write started last is done; :class:`CheckpointError` if it failed."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with announced(f"the checkpoint write in {self.folder}"):
                writer.join()
        failed, self._failed = self._failed, None
        if failed:
            raise CheckpointError(f"the local checkpoint write into {self.folder} failed "
                                  f"({failed}): is it full? choose another "
                                  f"--local-checkpoint-dir")  # fmt: skip

    # restoring

    def steps(self) -> list[int]:
        """The complete steps, oldest first, agreed by every process (a collective: every
        process calls it) from what each one's folders hold."""
        return sorted(self._agreed())

    def _agreed(self) -> dict[int, tuple[int, dict[int, int]]]:
        """``{step: (the processes that saved it, {origin: the process that restores it})}``
        for every complete step (of two saves of one step by other process counts, the
        last complete one)."""
        rows = [(s, n, o) for (s, n), origins in held(self.directory).items() for o in origins]
        found: dict[tuple[int, int], dict[int, list[int]]] = {}
        for process, theirs in enumerate(_allgathered(rows, self.nprocs)):
            for s, n, o in theirs:
                found.setdefault((s, n), {}).setdefault(o, []).append(process)
        complete: dict[int, tuple[int, dict[int, int]]] = {}
        for (s, n), origins in sorted(found.items()):
            if set(origins) == set(range(n)):  # its own process where it holds it, else spread
                complete[s] = (n, {o: o if o in h else h[o % len(h)] for o, h in origins.items()})
        return complete

    def restore(self, like: Any, shardings: Any, *, step: int | None = None,
                quarantine: bool = True) -> tuple[Any, dict[str, Any]]:  # fmt: skip
        """The newest complete step (or ``step``) read into ``shardings``, and its JSON. A
        step that cannot be read in some process, or whose bytes differ from their CRC, is
        said, set aside (renamed ``<step>.damaged`` where ``quarantine``) and the one before
        it tried; :class:`CheckpointError` when none is left."""
        agreed = self._agreed()
        candidates = sorted(agreed, reverse=True) if step is None else [step]
        if not candidates or candidates[0] not in agreed:
            raise CheckpointError(f"no complete local checkpoint in {self.directory}")
        problems = []
        for candidate in candidates:
            saved_by, holders = agreed[candidate]
            mine = [o for o, p in holders.items() if p == self.me]
            try:  # whatever goes wrong in one process, every process learns it below
                record, pieces, problem, folder = self._read(candidate, saved_by, mine)
            except Exception as exc:  # an index that lies: damage too
                record, pieces, problem, folder = None, [], f"{type(exc).__name__}: {exc}", None
            if not any(_allgathered([(1,)] if problem else [], self.nprocs)):
                record = _everywhere(record, self.nprocs)
                self._forget_after(candidate)
                return self._laid_out(candidate, record, pieces, like, shardings)
            if problem and quarantine and folder is not None:
                _set_aside(folder)
            problem = (f"local checkpoint of step {candidate} in {self.directory} is damaged"
                       f" ({problem or 'in another process'})")  # fmt: skip
            problems.append(problem)
            older = [c for c in candidates if c < candidate]
            warnings.warn(problem + (f"; trying step {older[0]}" if older else ""),
                          ShardplugWarning, stacklevel=2)  # fmt: skip
        raise CheckpointError("no good local checkpoint: " + "; ".join(problems))

    def _read(self, step: int, saved_by: int, origins: list[int]) -> tuple[
        dict[str, Any] | None, list[tuple[str, tuple[slice, ...], bytes]], str, Path | None
    ]:  # fmt: skip
        """Every shard of ``origins`` at ``step`` from the folders seen (an origin's own
        first), checked against its CRC: the step's JSON (None where this host has none of
        its folders), the pieces, what is wrong ("" if nothing) and the folder it is in."""
        pieces: list[tuple[str, tuple[slice, ...], bytes]] = []
        record = local_record(self.directory, step, saved_by) or None
        for origin in origins:
            folders = sorted(step_folders(self.directory, step, origin, saved_by),
                             key=lambda f: f.parent.name != f"p{origin}")  # fmt: skip
            folder = folders[0]
            try:
                entries = json.loads((folder / "index.json").read_text())["origins"]
                data = (folder / f"{origin}.bin").read_bytes()
            except (OSError, ValueError, KeyError) as exc:
                return record, [], f"{folder}: {exc}", folder
            for entry in entries[str(origin)]:
                chunk = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
                if len(chunk) != entry["nbytes"] or zlib.crc32(chunk) != entry["crc32"]:
                    return record, [], f"{folder}: {entry['name']} differs from its CRC", folder
                where = tuple(slice(a, b) for a, b in entry["index"])
                pieces.append((entry["name"], where, chunk))
        return record, pieces, "", None

    def _laid_out(self, step: int, record: dict[str, Any],
                  pieces: list[tuple[str, tuple[slice, ...], bytes]], like: Any,
                  shardings: Any) -> tuple[Any, dict[str, Any]]:  # fmt: skip
        path = self.path(step)
        names, leaves, treedef = state_leaves(like)
        expected = describe(names, leaves)
        frozen = record.get("frozen", {})
        _check_same_arrays(path, record.get("arrays", {}),
                           {n: expected[n] for n in names if n not in frozen})  # fmt: skip
        if frozen:
            _check_frozen(path, frozen, dict(zip(names, leaves, strict=True)))
        by_name: dict[str, list[tuple[tuple[slice, ...], bytes]]] = {}
        for name, where, data in pieces:
            by_name.setdefault(name, []).append((where, data))
        out = []
        for name, leaf, sharding in zip(names, leaves, jax.tree.leaves(shardings), strict=True):
            if name in frozen:
                out.append(jax.device_put(leaf, sharding))
                continue
            shape = tuple(expected[name]["shape"])
            dtype = np.dtype(expected[name]["dtype"])
            array = _assembled(shape, dtype, by_name.get(name, []), sharding, self.nprocs)
            if "key" in expected[name]:
                array = jax.random.wrap_key_data(array, impl=expected[name]["key"])
            out.append(array)
        meta = {k: v for k, v in record.items() if k not in ("origins", "writer")}
        return jax.tree.unflatten(treedef, out), meta

    def _forget_after(self, step: int) -> None:
        """Steps after the one restored belong to a timeline the run leaves: removed from this
        process's folder (process 0 also clears those of processes gone)."""
        folders = [self.folder]
        if self.me == 0:
            folders += [f for f in self.directory.glob("p*")
                        if f.name[1:].isdigit() and int(f.name[1:]) >= self.nprocs]  # fmt: skip
        for folder in folders:
            for s in steps_in(folder):
                if s > step:
                    shutil.rmtree(folder / str(s), ignore_errors=True)


def _copied(arrays: list[tuple[str, jax.Array]], me: int, nprocs: int) -> Pieces:
    """This process's shards (one replica of each) and its predecessor's, in host memory:
    ``{origin: [(name, slices, data)]}``. The predecessor's arrive by resharding each array
    onto its devices rotated by one process; chunks of :data:`CHUNK` bytes bound the copy."""
    pieces: Pieces = {me: []}
    before = (me - 1) % nprocs
    if nprocs > 1:
        pieces[before] = []
    chunk: list[tuple[int, str, tuple[slice, ...], jax.Array]] = []
    size = 0

    def drain() -> None:
        for *_, data in chunk:
            data.copy_to_host_async()
        for origin, name, index, data in chunk:
            host = np.asarray(data)  # a GPU's: a new host array, the async copy's
            kind = data.sharding.memory_kind
            if next(iter(data.devices())).platform == "cpu" or kind not in (None, "device"):
                host = host.copy()  # perhaps the buffer itself, which the next step donates
            pieces[origin].append((name, _slices(index, host.shape), host))
        chunk.clear()

    for name, x in arrays:
        held = [(me, s) for s in x.addressable_shards if s.replica_id == 0]
        if nprocs > 1:
            peer = jax.device_put(x, _rotated(x.sharding))
            held += [(before, s) for s in peer.addressable_shards if s.replica_id == 0]
        for origin, shard in held:
            data = shard.data  # one object: the copy is kept on it
            chunk.append((origin, name, shard.index, data))
            size += data.nbytes
        if size >= CHUNK:
            drain()
            size = 0
    drain()
    return pieces


def _slices(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A shard's index with every bound written (``slice(None)`` made ``slice(0, n)``)."""
    out = []
    for s, n in zip(index, shape, strict=False):
        start = s.start or 0
        out.append(slice(start, start + n))
    return tuple(out)


def _rotated(sharding: Any) -> Any:
    """``sharding`` on its devices rotated by one process: what device ``k`` of process ``i``
    holds, device ``k`` of process ``i + 1`` holds instead."""
    from jax.sharding import Mesh, NamedSharding

    if not isinstance(sharding, NamedSharding):
        raise CheckpointError(f"a local checkpoint copies NamedSharding arrays to a peer, not "
                              f"{type(sharding).__name__}")  # fmt: skip
    mesh = sharding.mesh
    by_process: dict[int, list[Any]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    mine = {d: sorted(v, key=lambda d: d.id) for d, v in by_process.items()}
    following = {d: mine[(p + 1) % len(mine)][k] for p, v in mine.items()
                 for k, d in enumerate(v)}  # fmt: skip
    devices = np.vectorize(following.__getitem__, otypes=[object])(mesh.devices)
    return NamedSharding(Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types),
                         sharding.spec, memory_kind=sharding.memory_kind)  # fmt: skip


def _assembled(shape: tuple[int, ...], dtype: Any, pieces: list[tuple[tuple[slice, ...], bytes]],
               sharding: Any, nprocs: int) -> jax.Array:  # fmt: skip
    """One array in ``sharding`` from the pieces each process holds of it: the bits summed
    over the processes (integers: exact) onto every device, then laid out from host memory
    into ``sharding``, whatever its mesh and memory."""
    width = np.dtype(f"uint{8 * dtype.itemsize}")
    bits = np.zeros(shape, width)
    for where, data in pieces:
        bits[where] = np.frombuffer(data, width).reshape([s.stop - s.start for s in where])
    if nprocs > 1:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        grid = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        mesh = Mesh(grid.reshape(nprocs, -1), ("processes", "local"))
        stacked = jax.make_array_from_single_device_arrays(
            (nprocs, *shape), NamedSharding(mesh, PartitionSpec("processes")),
            [jax.device_put(bits[None], d) for d in jax.local_devices()],
        )  # fmt: skip
        total = jax.jit(_sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
        bits = np.asarray(total.addressable_data(0))
    whole = bits != 0 if dtype == np.bool_ else bits.view(dtype)
    return jax.make_array_from_callback(shape, sharding, lambda index: whole[index])


def _sum(bits: jax.Array) -> jax.Array:
    return bits.sum(0, dtype=bits.dtype)  # one process wrote each element, zeros the rest


def _allgathered(rows: list[tuple[int, ...]], nprocs: int) -> list[list[tuple[int, ...]]]:
    """Every process's ``rows`` (tuples of ints of one length), by process."""
    if nprocs == 1:
        return [rows]
    from jax.experimental import multihost_utils

    width = len(rows[0]) if rows else 3
    counts = multihost_utils.process_allgather(np.int32(len(rows)))
    most = max(1, int(np.max(counts)))
    table = np.full((most, max(width, 3)), -1, np.int64)
    for k, row in enumerate(rows):
        table[k, : len(row)] = row
    every = np.asarray(multihost_utils.process_allgather(table.astype(np.int32)))
    return [[tuple(int(v) for v in every[p, k, :width]) for k in range(int(counts[p]))]
            for p in range(nprocs)]  # fmt: skip


def _everywhere(record: dict[str, Any] | None, nprocs: int) -> dict[str, Any]:
    """The step's JSON in every process (alike in all that wrote it), sent from the first
    process that has it to any whose host holds none of the step's folders."""
    if nprocs > 1:
        has = _allgathered([(1,)] if record is not None else [], nprocs)
        if any(has) and not all(has):
            from jax.experimental import multihost_utils

            source = jax.process_index() == next(p for p, rows in enumerate(has) if rows)
            data = np.frombuffer(json.dumps(record).encode(), np.uint8) if source else None
            size = multihost_utils.broadcast_one_to_all(
                np.int32(0 if data is None else data.size), is_source=source)  # fmt: skip
            mine = data if data is not None else np.zeros(int(size), np.uint8)
            sent = multihost_utils.broadcast_one_to_all(mine, is_source=source)
            record = json.loads(np.asarray(sent, np.uint8).tobytes())
    if record is None:
        raise CheckpointError("no process holds the local checkpoint's index")
    return record


def _set_aside(folder: Path) -> None:
    """Rename a damaged step's folder ``<step>.damaged`` (``.damaged.N`` when taken): a run
    going on from an older step may save that step again."""
    target = folder.with_name(f"{folder.name}.damaged")
    suffix = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.damaged.{suffix}")
        suffix += 1
    with contextlib.suppress(OSError):  # gone, or taken by another process: skipped the same
        folder.rename(target)
