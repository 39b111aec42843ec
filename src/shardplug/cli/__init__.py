"""The ``shardplug`` command line: list strategies, train with one chosen by name, export.

Every bad input ends in one line on stderr, ``shardplug: error: ...``, and exit code 2; a
run stopped by a non-finite loss exits 1; one stopped by SIGINT or SIGTERM (after saving)
exits 128 + the signal's number. An exception raised in a task's own code (its model, loss
or data) is one line too, naming where it was raised, and exits 1; ``SHARDPLUG_TRACEBACK=1``
prints the whole traceback instead.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

from shardplug.cli.config import parse_options
from shardplug.cli.parser import EXIT_BAD_INPUT, EXIT_FAILED, build_parser
from shardplug.cli.plan import cmd_bench, cmd_explain, cmd_recommend
from shardplug.cli.tools import cmd_export, cmd_launch, cmd_plot, cmd_strategies
from shardplug.cli.train import cmd_train
from shardplug.errors import (
    NonFiniteError,
    ShardplugError,
    ShardplugWarning,
    TrainingInterrupted,
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
    from shardplug.distributed import joined, leave

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
            where = _in_users_code(exc)
            if where is None or os.environ.get("SHARDPLUG_TRACEBACK"):
                raise  # shardplug's own failure, or asked for: the whole traceback
            error(
                f"the task's code raised {type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0]} ({where}); "
                f"SHARDPLUG_TRACEBACK=1 shows the traceback"
            )
            return EXIT_FAILED


def _in_users_code(exc: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of the traceback that is the user's
    code (not shardplug's, an installed library's or the standard library's); None if none."""
    paths = sysconfig.get_paths()
    libraries = (str(Path(__file__).resolve().parents[1]), *(
        str(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")
    ))  # fmt: skip
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if not frame.filename.startswith("<") and not path.startswith(libraries):
            return f"{os.path.relpath(path)}:{frame.lineno} in {frame.name}"
    return None


if __name__ == "__main__":
    sys.exit(main())
