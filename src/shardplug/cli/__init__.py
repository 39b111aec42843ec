"""The ``shardplug`` command line: list strategies, train with one chosen by name, export.

Every bad input ends in one line on stderr, ``shardplug: error: ...``, and exit code 2; a
run stopped by a non-finite loss exits 1; one stopped by SIGINT or SIGTERM (after saving)
exits 128 + the signal's number. An exception raised in a task's own code (its model, loss
or data) is one line too, naming where it was raised, and exits 1; ``SHARDPLUG_TRACEBACK=1``
prints the whole traceback instead.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardplug.cli.config import parse_options
from shardplug.cli.parser import EXIT_BAD_INPUT, EXIT_FAILED, build_parser
from shardplug.cli.plan import cmd_bench, cmd_explain, cmd_recommend
from shardplug.cli.tools import cmd_env, cmd_export, cmd_launch, cmd_plot, cmd_strategies
from shardplug.cli.train import cmd_train
from shardplug.errors import (
    NonFiniteError,
    ShardplugError,
    ShardplugWarning,
    TrainingInterrupted,
    one_line,
)

__all__ = ["build_parser", "main", "parse_options"]

COMMANDS = {
    "strategies": cmd_strategies,
    "train": cmd_train,
    "launch": cmd_launch,
    "explain": cmd_explain,
    "recommend": cmd_recommend,
    "bench": cmd_bench,
    "export": cmd_export,
    "plot": cmd_plot,
    "env": cmd_env,
}


def _warn_in_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"shardplug: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also for argparse's own errors).

    In a multi-process job a process that fails tells the others and ends at once (they
    stop within a second, naming it), rather than waiting at ``jax.distributed``'s shutdown.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:
        return int(exit.code or 0)
    _quiet_cuda_plugin()
    from shardplug.running.distributed import joined, leave

    errors: list[str] = []
    try:
        code = _run(args, errors)
    except Exception:
        if not joined():
            raise
        traceback.print_exc()
        leave(EXIT_FAILED, "shardplug raised an exception; its traceback is in its output")
    if errors and joined():
        leave(code, errors[-1])
    return code


class _CudaPlugin(logging.Filter):
    """JAX's CUDA plugin where CUDA is missing (``shardplug[target]`` installs it to compile
    for GPUs not here): JAX logs its failed start as a 20-line traceback before every
    command. Without an NVIDIA GPU that is expected, and said nowhere; with one, one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Jax plugin configuration error" not in str(record.msg) or not record.exc_info:
            return True
        from shardplug.core.devices import nvidia_gpus

        if not nvidia_gpus():
            return False
        cause = record.exc_info[1]
        record.msg = ("JAX's CUDA plugin could not start (%s): JAX runs on the CPU; install "
                      "CUDA's libraries (pip install -e '.[cuda]')")  # fmt: skip
        record.args, record.exc_info, record.exc_text = (str(cause),), None, None
        return True


def _quiet_cuda_plugin() -> None:
    logging.getLogger("jax._src.xla_bridge").addFilter(_CudaPlugin())


def _run(args, errors: list[str]) -> int:
    def error(line: str) -> None:
        errors.append(line)
        print(f"shardplug: error: {line}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        # shardplug's warnings are reports to the user (a damaged checkpoint, a broken
        # plugin): always one line each, whatever filters the caller has set
        warnings.simplefilter("always", ShardplugWarning)
        warnings.showwarning = _warn_in_one_line
        try:
            return COMMANDS[args.command](args)
        except TrainingInterrupted as exc:
            print(f"shardplug: {exc}", file=sys.stderr)
            return 128 + exc.signal
        except NonFiniteError as exc:
            error(str(exc))
            return EXIT_FAILED
        except ShardplugError as exc:
            error(str(exc))
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("shardplug: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            if (isinstance(exc, OSError) and _given(exc.filename, args)
                    and not os.environ.get("SHARDPLUG_TRACEBACK")):  # fmt: skip
                error(_path_error(exc))  # a path the command was given: the user's to fix
                return EXIT_BAD_INPUT
            part, where = who_raised(exc)
            if part.startswith("shardplug") or os.environ.get("SHARDPLUG_TRACEBACK"):
                if part.startswith("shardplug"):  # shardplug's own failure: a bug to report
                    print(f"shardplug: error: {part} raised {type(exc).__name__} ({where}), "
                          "a bug in shardplug; its traceback follows", file=sys.stderr)  # fmt: skip
                raise
            error(
                f"{part} raised {type(exc).__name__}: {one_line(exc)} ({where}); "
                f"SHARDPLUG_TRACEBACK=1 shows the traceback"
            )
            return EXIT_FAILED


def _given(filename: Any, args: Any) -> bool:
    """Whether ``filename`` is a path the command line gave, or in or above one."""
    if filename is None:
        return False
    where = os.path.abspath(os.fsdecode(filename))
    for value in vars(args).values():
        if isinstance(value, str | Path) and str(value):
            given = os.path.abspath(os.fsdecode(value))
            if where == given or given.startswith(where + os.sep) or where.startswith(
                    given + os.sep):  # fmt: skip
                return True
    return False


def _path_error(exc: OSError) -> str:
    """A file or folder the command was given, unreadable, read-only or a file where a
    folder is needed, in one line."""
    named = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename
    why = exc.strerror or str(exc)
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and Path(exc.filename).is_file():
        why = "a file, where a folder is needed"
    return f"{named}: {why}; check the path and its permissions"


def who_raised(exc: BaseException) -> tuple[str, str]:
    """Which part raised ``exc``, and where (``file:line in function``): the innermost frame
    of its traceback that is not an installed library's or the standard library's. An
    installed plugin's package is ``the plugin NAME (package DIST)``, shardplug's own code
    ``shardplug's core`` (or ``shardplug's built-in plugin NAME``), any other ``the task's
    code``."""
    paths = sysconfig.get_paths()
    libraries = tuple(
        str(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")
    )
    plugins = _plugin_packages()
    for frame, line in reversed(list(traceback.walk_tb(exc.__traceback__))):
        code, module = frame.f_code, str(frame.f_globals.get("__name__", ""))
        path = str(Path(code.co_filename).resolve())
        where = f"{os.path.relpath(path)}:{line} in {code.co_name}"
        top = module.partition(".")[0]
        if top in plugins:
            return plugins[top], where
        if top == "shardplug":
            builtin = module.startswith("shardplug.strategies.")
            name = f"built-in plugin {module.split('.')[2]}" if builtin else "core"
            return f"shardplug's {name}", where
        if not code.co_filename.startswith("<") and not path.startswith(libraries):
            return "the task's code", where
    return "shardplug's core", "no frame of its own"


def _plugin_packages() -> dict[str, str]:
    """The top-level module of each installed plugin (a strategy, an add-on or a pipeline
    schedule: the entry-point groups ``shardplug``, ``shardplug.addons``,
    ``shardplug.schedules``), and how to name it."""
    import importlib.metadata

    named = {}
    for group in ("shardplug", "shardplug.addons", "shardplug.schedules"):
        for entry in importlib.metadata.entry_points(group=group):
            top = entry.value.partition(":")[0].partition(".")[0]
            if top != "shardplug":
                package = entry.dist.name if entry.dist is not None else top
                named.setdefault(top, f"the plugin {entry.name} (package {package})")
    return named


if __name__ == "__main__":
    sys.exit(main())
