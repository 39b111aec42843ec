"""Figures as people read them: the reports of explain, recommend and bench, and the
command line's lines, say bytes one way."""

from __future__ import annotations


def size(n: float | None) -> str:
    """``1234567`` as ``1.2 MB`` (powers of 1000)."""
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def count(n: float) -> str:
    """``41943040`` as ``41.9M`` (powers of 1000), ``8030261248`` as ``8.03B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"
