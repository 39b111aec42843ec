"""The ``shardplug`` command line: list strategies, train with one chosen by name, export.

Every bad input ends in one line on stderr, ``shardplug: error: ...``, and exit code 2; a
run stopped by a non-finite loss exits 1; one stopped by SIGINT or SIGTERM (after saving)
exits 128 + the signal's number.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from shardplug.cli._common import EXIT_BAD_INPUT, EXIT_FAILED, parse_options
from shardplug.cli.parser import build_parser
from shardplug.cli.plan import cmd_bench, cmd_explain, cmd_recommend
from shardplug.cli.tools import cmd_export, cmd_launch, cmd_strategies
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
}


def _warn_in_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"shardplug: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also for argparse's own errors)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:
        return int(exit.code or 0)
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
            print(f"shardplug: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except ShardplugError as exc:
            print(f"shardplug: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            print("shardplug: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
