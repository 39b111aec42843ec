"""What shardplug ships for testing strategies: a pytest plugin and a conformance suite.

``from shardplug.testing import StrategyConformance`` gives the suite. The pytest plugin
(``shardplug.testing.pytest_plugin``, loaded automatically through the ``pytest11`` entry
point) provides the ``shardplug_strategy``, ``shardplug_adapter`` and ``shardplug_model``
fixtures and simulated devices. Importing this package imports no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["StrategyConformance"]


def __getattr__(name: str) -> Any:
    if name == "StrategyConformance":
        from shardplug.testing.conformance import StrategyConformance

        return StrategyConformance
    raise AttributeError(f"module 'shardplug.testing' has no attribute {name!r}")


if TYPE_CHECKING:
    from shardplug.testing.conformance import StrategyConformance
