"""Faster compiles for this package's tests (they pass without it): the conformance suite
compares numbers and shardings, not speed (shardplug.testing.pytest_plugin.compile_fast)."""

from shardplug.testing.pytest_plugin import compile_fast

compile_fast()
