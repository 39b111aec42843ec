"""Where the frequent tier's checkpoints lie (``DIR/p<i>/<step>/``, each with an
``index.json``), read without JAX: what the launcher and the command line see of it, and what
``local_checkpoint`` restores from (see that module)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def steps_in(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())


def step_folders(directory: Path, step: int, origin: int | None,
                  saved_by: int | None = None) -> list[Path]:  # fmt: skip
    """The folders of ``step`` seen here that hold ``origin``'s shards (any, for None), saved
    by ``saved_by`` processes (any count, for None)."""
    found = []
    for folder in sorted(directory.glob(f"p*/{step}")):
        if origin is not None and not (folder / f"{origin}.bin").is_file():
            continue
        if saved_by is not None and _saved_by(folder) != saved_by:
            continue
        found.append(folder)
    return found


def _saved_by(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / "index.json").read_text())["nprocs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def held(directory: Path) -> dict[tuple[int, int], set[int]]:
    """``{(step, processes that saved it): origins held}`` in the folders seen here."""
    held: dict[tuple[int, int], set[int]] = {}
    for process in sorted(directory.glob("p*")):
        for step in steps_in(process):
            try:
                record = json.loads((process / str(step) / "index.json").read_text())
                key = (step, int(record["nprocs"]))
                held.setdefault(key, set()).update(int(o) for o in record["origins"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable: not counted (the restore would find it damaged)
    return held


def complete_local_steps(directory: Path) -> list[int]:
    """The steps complete in the folders seen from here, oldest first (no collective: the
    launcher's and the command line's view)."""
    steps = {s for (s, n), origins in held(directory).items() if origins >= set(range(n))}
    return sorted(steps)


def local_record(directory: Path, step: int, saved_by: int | None = None) -> dict[str, Any]:
    """The JSON of local step ``step`` (best effort: {} when unreadable)."""
    for folder in step_folders(directory, step, None, saved_by):
        try:
            record = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            return record
    return {}


def is_local(directory: Path) -> bool:
    """Whether ``directory`` is a frequent tier's (its folders ``p<i>``)."""
    return directory.is_dir() and any(
        p.is_dir() and p.name[1:].isdigit() for p in directory.glob("p*")
    )
