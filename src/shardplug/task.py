"""Tasks: a user's model, loss, optimizer and data, for the command line to run.

``shardplug train --task my_task.py:task`` (or ``--task my_package.tasks:task``) loads
``task`` from that file or module: a :class:`Task`, or a function returning one. The
reference models are tasks too (:mod:`shardplug.builtin_tasks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import optax

from shardplug.core.step import LossFn
from shardplug.errors import TaskError
from shardplug.loop.evaluate import ONE_SHOT, one_shot
from shardplug.models.adapter import Adapter, check_parts

Data = Iterable[Any] | Callable[[], Iterable[Any]]


@dataclasses.dataclass
class Task:
    """What to train: everything ``shardplug train``, ``explain``, ``recommend``, ``bench``
    and ``export`` need besides the strategy.

    :param adapter: the model, adapted (:func:`shardplug.from_nnx` and its kin). To plan a
        model larger than this machine's memory, give ``from_nnx`` a function that builds it:
        ``explain`` then never allocates a parameter.
    :param loss_fn: ``loss_fn(model, batch)``, as for :class:`shardplug.Trainer`.
    :param optimizer: an optax transformation.
    :param data: the training batches: a :class:`shardplug.running.data.Batches` (resumes exactly,
        from the state saved in each checkpoint), or any iterable of global batches, or a
        function returning one (resumed by skipping the batches already trained on, so it
        must give the same batches each time it is iterated).
    :param eval_data: held-out batches for ``--eval-every``: an iterable that can be read
        again (a list, a ``Batches``) or a function returning one.
    :param eval_steps: how many evaluation batches to read (needed for an endless one; a
        source without a length is otherwise read to at most 1,000 batches).
    :param name: what the command line calls it.
    :param flops_per_sample: training FLOPs of one sample (:mod:`shardplug.core.flops`), for
        ``model_tflops`` and MFU by the textbook count; the compiled step's count otherwise.
    """

    adapter: Adapter
    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    data: Data
    eval_data: Data | None = None
    eval_steps: int | None = None
    name: str = "task"
    flops_per_sample: float | None = None

    def __post_init__(self) -> None:
        check_parts(self.adapter, self.loss_fn, self.optimizer, TaskError, f"task {self.name!r}")
        for field in ("data", "eval_data"):
            value = getattr(self, field)
            if value is not None and not (callable(value) or isinstance(value, Iterable)):
                raise TaskError(
                    f"task {self.name!r}: {field} must be an iterable of batches or a function "
                    f"returning one, got {type(value).__name__}"
                )

        if one_shot(self.eval_data):
            raise TaskError(f"task {self.name!r}: {ONE_SHOT}")

    def trainer(self, **options: Any) -> Any:
        """A :class:`shardplug.Trainer` of this task: its adapter, loss and optimizer, and its
        FLOPs per sample for the rows' ``model_tflops`` and MFU. ``options`` are the
        trainer's other arguments (``strategy``, ``devices``, ``mesh``, ``precision``, ...)::

            trainer = task.trainer(strategy="fsdp", precision="bf16")
            trainer.fit(task.batches(), steps=100)

        The one way every command (through ``shardplug.cli.config.trainer_for``), ``bench``
        and the conformance suite build a trainer; it is ``shardplug.Trainer(task.adapter,
        loss_fn=task.loss_fn, optimizer=task.optimizer, flops_per_sample=...)``.
        """
        from shardplug.trainer import Trainer

        options = {"flops_per_sample": self.flops_per_sample, **options}
        return Trainer(self.adapter, loss_fn=self.loss_fn, optimizer=self.optimizer, **options)

    def batches(self, start: int = 0) -> Iterable[Any]:
        """The training batches from batch 0 (a stateful ``Batches`` is positioned by the
        trainer); an iterable without state skips ``start`` batches."""
        data = self.data() if callable(self.data) else self.data
        if start and not _stateful(data):
            return itertools.islice(data, start, None)
        return data

    def evaluation(self) -> Iterable[Any] | None:
        """The held-out batches, afresh; None when the task has none."""
        if self.eval_data is None:
            return None
        return self.eval_data() if callable(self.eval_data) else self.eval_data


def _check_takes(value: Any, sizes: dict[str, Any], spec: str, name: str) -> None:
    """``value`` is a function taking every keyword in ``sizes``, or one TaskError line."""
    import inspect

    try:
        params = inspect.signature(value).parameters if not isinstance(value, Task) else {}
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in sizes if k not in params and not takes_any]
    if missing:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in missing)
        signature = f"def {name}({', '.join(f'{k}=...' for k in missing)}) -> Task"
        raise TaskError(
            f"task {spec}: {name} takes no {', '.join(missing)}, so {flags} cannot size it: "
            f"make it a function that does ({signature})"
        )


def _stateful(data: Any) -> bool:
    return hasattr(data, "get_state") or hasattr(iter(data), "get_state")


def load_task(spec: str, **sizes: Any) -> Task:
    """The task that ``spec`` names: ``path/to/file.py:NAME`` or ``package.module:NAME``
    (``NAME`` defaults to ``task``). A file imports the modules beside it, as ``python
    file.py`` would: its folder is on ``sys.path``, searched first while the file is imported
    and last afterwards. :class:`TaskError` with one line for a file or module that is not
    there or fails to import, a missing ``NAME``, or one that is not a Task.

    ``sizes`` (``sequence=32768``, ``batch_size=1``: what ``--sequence`` and planning at
    length give) are passed to a function ``NAME`` that takes them; one that does not is a
    :class:`TaskError` saying so."""
    where, _, name = spec.rpartition(":") if ":" in spec else (spec, ":", "task")
    if not where or not name.isidentifier():
        raise TaskError(f"--task {spec!r} is not FILE.py:NAME or package.module:NAME")
    module = _import(where, spec)
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if isinstance(v, Task) and k[:1] != "_"]
        has = f"; it has the Task(s) {', '.join(found)}" if found else ""
        raise TaskError(f"task {where!r} defines no {name!r}{has}")
    value = getattr(module, name)
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if sizes:
        _check_takes(value, sizes, spec, name)
    if callable(value) and not isinstance(value, Task):
        try:
            value = value(**sizes)
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(
                f"task {spec}: {name}() failed: {type(exc).__name__}: {_line(exc)}"
            ) from exc
    if not isinstance(value, Task):
        raise TaskError(
            f"task {spec}: {name} is a {type(value).__name__}, not a shardplug.Task (or a "
            f"function returning one)"
        )
    if value.name == "task":
        value.name = name
    return value


#: the folders of task files this process put on ``sys.path`` (see :func:`_beside`)
_FOLDERS: set[str] = set()


def _import(where: str, spec: str) -> Any:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TaskError(f"task file {where} does not exist")
        module_name = f"_shardplug_task_{path.stem}_{abs(hash(str(path.resolve())))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            with _beside(path.resolve().parent):
                loader.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise TaskError(
                f"task file {where} failed to import: {type(exc).__name__}: {_line(exc)}"
            ) from exc
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise TaskError(f"task module {where!r} not found ({_line(exc)})") from exc
    except Exception as exc:
        raise TaskError(
            f"task module {where} failed to import: {type(exc).__name__}: {_line(exc)}"
        ) from exc


@contextlib.contextmanager
def _beside(folder: Path) -> Iterator[None]:
    """The task file's ``folder`` on ``sys.path``, so that it imports the modules beside it
    as ``python task.py`` would: first while the file is imported, last afterwards (its
    modules may import more later, but nothing installed is shadowed by a file that happens
    to share its name). A folder already on the path by the user's doing stays as it is.
    Modules a task in another folder imported from beside it are forgotten where this folder
    has its own of that name: two tasks' ``model.py`` are two modules."""
    entry = str(folder)
    if entry in sys.path and entry not in _FOLDERS:
        yield
        return
    others = _FOLDERS - {entry}
    for name, module in list(sys.modules.items()) if others else ():
        top = folder / name.partition(".")[0]
        if _home(name, module) in others and (top.with_suffix(".py").is_file() or top.is_dir()):
            del sys.modules[name]
    kept = entry in _FOLDERS
    if entry in sys.path:  # put there by an earlier task: first again for now
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    try:
        yield
        kept = True
    finally:
        if entry in sys.path:
            sys.path.remove(entry)
        if kept:
            sys.path.append(entry)
            _FOLDERS.add(entry)


def _home(name: str, module: Any) -> str | None:
    """The folder on ``sys.path`` that the module ``name`` was imported from."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return None
    path = Path(file)
    up = name.count(".") + (path.stem == "__init__")
    return str(path.parents[up]) if up < len(path.parents) else None


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["Task", "load_task"]
