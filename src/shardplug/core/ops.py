"""The operations a parallelism may compute its own way: attention, a mixture of experts'
product, a layer stack's loop.

A model calls :func:`shardplug.attention`, :func:`shardplug.moe.routed_experts` and
:mod:`shardplug.stack`; each asks :func:`supplied` whether a parallelism of the run supplies
its own implementation (through the ``operations`` hook, an :class:`Operations` record) and
runs that while the step is traced, so the model's code does not change between strategies.
Core installs the records of the run's parallelisms around every traced program
(:func:`supplying`), refuses two that supply the same operation, and tells a parallelism
which of its operations a program never called (:attr:`Operations.unused`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from shardplug.errors import CompositionError, PluginError


class Attention(Protocol):
    """``(query, key, value, *, causal, bias, mask, scale) -> output``: what
    :func:`shardplug.attention` returns, over ``(batch, sequence, heads, head_dim)`` arrays
    (key and value may have fewer heads, dividing the query's). One that declares a
    ``segment_ids=None`` keyword of its own is given packed documents' ids
    (``(batch, sequence)``); one that does not, their mask, joined to ``mask``."""

    def __call__(self, query: Any, key: Any, value: Any, *, causal: bool, bias: Any,
                 mask: Any, scale: float | None) -> Any: ...  # fmt: skip


class Experts(Protocol):
    """``(x, routing, w_in, w_out, *, w_gate, capacity_factor, capacity_groups, activation)
    -> (output, kept)`` for :func:`shardplug.moe.routed_experts`: the experts' output for the
    tokens ``x`` (tokens, width) and each expert's count of kept assignments (E,) float32;
    or None to have the layer computed as without it."""

    def __call__(self, x: Any, routing: Any, w_in: Any, w_out: Any, *, w_gate: Any,
                 capacity_factor: float | None, capacity_groups: int,
                 activation: Callable[[Any], Any]) -> tuple[Any, Any] | None: ...  # fmt: skip


class LayerStack(Protocol):
    """``(block, params, x, *, layers[, rows]) -> output`` for :mod:`shardplug.stack`:
    ``block(layer params, h)`` applied for each of the ``layers`` leading slices of
    ``params`` in turn, returning ``h`` or ``(h, aux)`` (aux then stacked per layer, as the
    plain scan does). An operation that takes ``rows=`` is given the stack's row inputs (a
    dict of arrays leading with ``x``'s rows: packed documents' segment ids; empty where
    the model gives none) and blocks called ``block(layer params, h, rows)`` with the rows
    of the ``h`` they are given (a loop that runs the blocks on microbatches cuts the rows
    alike); one that does not is given blocks closed over the whole batch's rows (and,
    where there are any, a warning, once)."""

    def __call__(self, block: Callable[..., Any], params: Any, x: Any, *, layers: int,
                 rows: Any = None) -> Any: ...  # fmt: skip


#: the operations a parallelism may supply, by the name of their :class:`Operations` field
NAMES = ("attention", "experts", "layer_stack")


@dataclasses.dataclass(frozen=True)
class Operations:
    """What a parallelism computes its own way while the step is traced (its ``operations``
    hook returns one); a field left None is computed as without it.

    :param attention: in place of :func:`shardplug.attention`'s inside.
    :param experts: in place of :func:`shardplug.moe.routed_experts`'s local product.
    :param layer_stack: in place of a layer stack's scan.
    :param unused: called, after a program was traced, with the name of each of these
        operations the model never called (to warn that the parallelism did nothing there).
    """

    attention: Attention | None = None
    experts: Experts | None = None
    layer_stack: LayerStack | None = None
    unused: Callable[[str], None] | None = None

    def given(self) -> tuple[str, ...]:
        return tuple(n for n in NAMES if getattr(self, n) is not None)


_ACTIVE: contextvars.ContextVar[dict[str, Callable[..., Any]] | None] = contextvars.ContextVar(
    "shardplug_operations", default=None
)


def supplied(name: str) -> Callable[..., Any] | None:
    """The implementation of operation ``name`` the current program runs, or None."""
    return (_ACTIVE.get() or {}).get(name)


@contextlib.contextmanager
def override(name: str, implementation: Callable[..., Any] | None) -> Iterator[None]:
    """Trace the code inside with ``implementation`` as operation ``name`` (None: none)."""
    token = _ACTIVE.set({**(_ACTIVE.get() or {}), name: implementation})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Trace the code inside with no operation supplied: as one device computes it (a
    block run under ``vmap`` only to make its parameters)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def supplying(records: Sequence[tuple[str, Any]]) -> Iterator[None]:
    """Trace the code inside with the operations of ``records`` (``(parallelism name,
    Operations or None)``) installed; refuses two parallelisms that supply one operation,
    and tells each which of its operations were never called."""
    owners: dict[str, str] = {}
    called: dict[str, bool] = {}
    installed = dict(_ACTIVE.get() or {})
    for owner, ops in records:
        if ops is None:
            continue
        if not isinstance(ops, Operations):
            raise PluginError(
                f"parallelism {owner!r}: operations returned {ops!r}, not an Operations"
            )
        for name in ops.given():
            if name in owners:
                raise CompositionError(
                    f"{owners[name]!r} and {owner!r} both supply {name}: a composition takes "
                    f"each operation from one parallelism at most"
                )
            owners[name] = owner
            called[name] = False
            installed[name] = _counted(getattr(ops, name), name, called)
    token = _ACTIVE.set(installed)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
    for _, ops in records:
        if ops is not None and ops.unused is not None:
            for name in ops.given():
                if not called[name]:
                    ops.unused(name)


_LENGTHS: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "shardplug_sequence_lengths", default=None
)


@contextlib.contextmanager
def reading_lengths() -> Iterator[set[int]]:
    """Trace the code inside recording the sequence lengths :func:`shardplug.attention`
    reads (its queries' and keys' second dimension): the set yielded fills as it traces."""
    seen: set[int] = set()
    token = _LENGTHS.set(seen)
    try:
        yield seen
    finally:
        _LENGTHS.reset(token)


def read_sequence(*lengths: int) -> None:
    """Note that the model's attention read sequences of ``lengths`` (where recorded)."""
    seen = _LENGTHS.get()
    if seen is not None:
        seen.update(int(n) for n in lengths)


def _counted(fn: Callable[..., Any], name: str, called: dict[str, bool]) -> Callable[..., Any]:
    @functools.wraps(fn)  # its signature read through: what it takes (attention's segment_ids)
    def counted(*args: Any, **kwargs: Any) -> Any:
        called[name] = True
        return fn(*args, **kwargs)

    return counted
