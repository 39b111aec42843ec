"""The layers stay as docs/architecture.md draws them, and no module grows past reading."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "shardplug"
MAX_LINES = 500


def test_imports_point_down_the_layers():
    beside = Path(sys.executable).parent / "lint-imports"  # this interpreter's environment
    lint = str(beside) if beside.exists() else shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports (import-linter) is missing: pip install -e '.[test]'")
    done = subprocess.run(
        [lint, "--config", str(SRC.parent.parent / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SRC.parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_no_module_is_over_500_lines():
    long = {
        str(path.relative_to(SRC)): n
        for path in SRC.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules: {long}"


def test_no_module_reaches_into_a_trainer():
    """The loop, evaluation and the commands take the program and the state as values and
    read a Trainer's public attributes only (they used to set its private fields)."""
    private = re.compile(r"\btrainer\._\w+|\bself\._trainer\._\w+")
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "trainer.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, "\n".join(found)
