"""Where the data stands: the state of a resumable iterator before each batch it gave."""

from __future__ import annotations

import base64
import collections
from collections.abc import Iterator
from typing import Any

# States kept: enough for the batch the loop has read ahead and a checkpoint's step.
KEPT = 8
#: a restored checkpoint that saved no data state (an older one): skip to its step
SKIP = "skip"


def stateful(iterator: Any) -> bool:
    """Whether ``iterator`` can say where it is and go back there (Grain's iterators,
    :class:`shardplug.running.data.Batches`'): ``get_state()`` and ``set_state(state)``."""
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class Tracked(Iterator[Any]):
    """Reads ``iterator`` and remembers its state before each batch, by data position (the
    step that batch trains), so a checkpoint at step ``s`` can store where batch ``s``
    starts even though the loop has already read ahead."""

    def __init__(self, iterator: Any, position: int):
        self.iterator, self.position = iterator, position
        self.states: collections.OrderedDict[int, Any] = collections.OrderedDict()

    @classmethod
    def resumed(cls, iterator: Any, position: int, state: Any) -> Tracked:
        """``iterator`` put where a restored checkpoint's data was: its saved ``state``, or,
        for a checkpoint that saved none (:data:`SKIP`), ``position`` batches read past."""
        if state == SKIP:
            for _ in range(position):
                next(iterator)
        elif state is not None:
            iterator.set_state(decode(state))
        return cls(iterator, position)

    def __next__(self) -> Any:
        self.states[self.position] = self.iterator.get_state()
        if len(self.states) > KEPT:
            self.states.popitem(last=False)
        batch = next(self.iterator)
        self.position += 1
        return batch

    def state_at(self, position: int) -> Any:
        """The iterator's state before batch ``position``, JSON-ready; None if not kept."""
        if position == self.position:
            return encode(self.iterator.get_state())
        return encode(self.states[position]) if position in self.states else None


def encode(state: Any) -> Any:
    """A state as JSON can hold it (Grain's DataLoader gives bytes)."""
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode()}
    return state


def decode(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"bytes"}:
        return base64.b64decode(state["bytes"])
    return state
