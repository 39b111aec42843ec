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


BUILT_IN = ("dp", "fsdp", "tp", "pp", "cp", "ep", "2d", "pmap")


def test_core_names_no_parallelism_and_no_axis_of_one():
    """Core is the contract, the composition, the traced step and the mesh utilities: no
    built-in parallelism's name appears in it (code, comments, docstrings), and no axis of
    theirs as a string in its code or quoted in its text (RANK, in shardplug.plugin, states
    them once)."""
    import ast
    import io
    import tokenize

    from shardplug.plugin import RANK

    words = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, BUILT_IN)) + r")(?![\w-])")
    quoted = re.compile(r"[\"'`](" + "|".join(RANK) + r")[\"'`]")
    found = []
    for path in sorted((SRC / "core").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(SRC)
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.NAME, tokenize.COMMENT, tokenize.STRING):
                found += [f"{name}:{token.start[0]}: {m}" for m in words.findall(token.string)]
                found += [f"{name}:{token.start[0]}: {m}" for m in quoted.findall(token.string)]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and node.value in RANK:
                found.append(f"{name}:{node.lineno}: {node.value!r}")
    # a run with no strategy at all is data parallel, on core's fallback mesh of one axis
    found = [f for f in found if not f.startswith("core/fallbacks.py:36: ")]
    assert not found, "\n".join(sorted(set(found)))
