"""What ``explain`` reads off a compiled step, handed to each parallelism to describe its own
share (:func:`~shardplug.core.hookspecs.explain_step`), and what it answers."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """A compiled training step, as ``explain`` sees it (nothing allocated).

    :param mesh: the run's mesh.
    :param jaxpr: the traced step (``jax.extend.core.ClosedJaxpr``).
    :param collectives: the compiled program's collectives, one dict per kind:
        ``kind``, ``count``, ``bytes`` (per device), ``wire_bytes`` (sent per device).
    :param param_paths: every parameter's path, in ``jax.tree.leaves`` order.
    :param params: every parameter as a ``jax.ShapeDtypeStruct``.
    :param stored: every parameter's stored ``PartitionSpec``.
    :param used: every parameter's ``PartitionSpec`` where the step uses it.
    :param batch: every batch leaf as a global ``jax.ShapeDtypeStruct``.
    :param batch_shardings: every batch leaf's ``NamedSharding``.
    :param batch_axes: the mesh axes the batch's rows split over.
    """

    mesh: Any
    jaxpr: Any
    collectives: list[dict[str, Any]]
    param_paths: list[str]
    params: list[Any]
    stored: list[Any]
    used: list[Any]
    batch: list[Any]
    batch_shardings: list[Any]
    batch_axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Explained:
    """A parallelism's own account of its share of a step.

    :param name: the key of ``report`` in explain's JSON (``"pipeline"``, ``"sequence"``);
        None with notes only.
    :param report: figures for the JSON (plain numbers, strings, lists and dicts).
    :param notes: lines for the printed report: where the program and the textbook part
        ways, and why.
    """

    name: str | None = None
    report: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
