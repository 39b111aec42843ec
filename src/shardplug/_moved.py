"""Module paths that moved when the package was grouped by purpose (``planning/``,
``finetuning/``, ``running/``, ``core/compiled/``, ``core/operations/``), kept importable for
one release: ``from shardplug.explain import explain`` still works, warns once (a
``FutureWarning`` naming the new path), and gives the very module the new path does (one
module object: patching either patches both). The one alias mechanism: a finder consulted
after every other, for these names alone."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: each moved module's old dotted path and its new one
MOVED = {
    "shardplug.explain": "shardplug.planning.explain",
    "shardplug.explain_memory": "shardplug.planning.explain_memory",
    "shardplug.explain_collectives": "shardplug.planning.explain_collectives",
    "shardplug.explain_time": "shardplug.planning.explain_time",
    "shardplug.views": "shardplug.planning.views",
    "shardplug.recommend": "shardplug.planning.recommend",
    "shardplug.longest": "shardplug.planning.longest",
    "shardplug.bench": "shardplug.planning.bench",
    "shardplug.bench_plan": "shardplug.planning.bench_plan",
    "shardplug.flops": "shardplug.core.flops",
    "shardplug.units": "shardplug.core.units",
    "shardplug.lora": "shardplug.finetuning.lora",
    "shardplug.quantize": "shardplug.finetuning.quantize",
    "shardplug.float8": "shardplug.finetuning.float8",
    "shardplug.checkpoint": "shardplug.running.checkpoint",
    "shardplug.checkpoint_checks": "shardplug.running.checkpoint_checks",
    "shardplug.data": "shardplug.running.data",
    "shardplug.optim": "shardplug.running.optim",
    "shardplug.launch": "shardplug.running.launch",
    "shardplug.distributed": "shardplug.running.distributed",
    "shardplug.native": "shardplug.running.native",
    "shardplug.orbax_noise": "shardplug.running.orbax_noise",
    "shardplug.export": "shardplug.running.export",
    "shardplug.core.hlo": "shardplug.core.compiled.hlo",
    "shardplug.core.program": "shardplug.core.compiled.program",
    "shardplug.core.branches": "shardplug.core.compiled.branches",
    "shardplug.core.timing": "shardplug.core.compiled.timing",
    "shardplug.core.kernel_time": "shardplug.core.compiled.kernel_time",
    "shardplug.core.chips": "shardplug.core.compiled.chips",
    "shardplug.core.targets": "shardplug.core.compiled.targets",
    "shardplug.core.facts": "shardplug.core.compiled.facts",
    "shardplug.core.attention": "shardplug.core.operations.attention",
    "shardplug.core.flash": "shardplug.core.operations.flash",
    "shardplug.core.flash_pairs": "shardplug.core.operations.flash_pairs",
    "shardplug.core.layer_gather": "shardplug.core.operations.layer_gather",
    "shardplug.core.layer_stack": "shardplug.core.operations.layer_stack",
    "shardplug.core.remat": "shardplug.core.operations.remat",
    "shardplug.core.beside": "shardplug.core.operations.beside",
    "shardplug.core.held": "shardplug.core.operations.held",
    "shardplug.core.rewrite": "shardplug.core.operations.rewrite",
}

class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path (nothing else does, the file having moved) and loads it as the
    module at its new path. The import system caches it under the old name too, so it warns
    once."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}  # the real module's spec, while the alias loads

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there (the old path goes in the "
            f"next release)",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing runs (the module ran at its new path); its own spec put back, which the
        import system replaced by the alias's (``reload`` and ``find_spec`` read it)."""
        real = self._specs.pop(module.__spec__.name, None)
        if real is not None:
            module.__spec__ = real


def install() -> None:
    """Add the finder (once), after every other."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
