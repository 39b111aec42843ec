"""What shardplug ships for testing strategies: a pytest plugin and a conformance suite.

``from shardplug.testing import StrategyConformance`` gives the suite. The pytest plugin
(``shardplug.testing.pytest_plugin``, loaded automatically through the ``pytest11`` entry
point) provides the ``shardplug_strategy``, ``shardplug_adapter`` and ``shardplug_model``
fixtures and simulated devices. Importing this package imports no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardplug._lazy import submodule

__all__ = ["StrategyConformance"]


def __getattr__(name: str) -> Any:
    if name == "StrategyConformance":
        from shardplug.testing.conformance import StrategyConformance

        return StrategyConformance
    return submodule(__name__, name)


if TYPE_CHECKING:
    from shardplug.testing.conformance import StrategyConformance
