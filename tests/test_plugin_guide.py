"""The plugin author guide runs: its files are written, installed with pip, listed, trained
from the command line, and its tests (the conformance suite) pass in a real pytest run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def test_the_guide_builds_a_working_strategy(tmp_path):
    files = re.findall(r"```\w+ file=(\S+)\n(.*?)```", GUIDE.read_text(), re.S)
    assert [name for name, _ in files] == [
        "pyproject.toml",
        "shardplug_megatron.py",
        "test_megatron.py",
    ]
    project, site = tmp_path / "project", tmp_path / "site"
    project.mkdir()
    for name, text in files:
        (project / name).write_text(text)
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SHARDPLUG_PLUGINS", None)

    def run(*args, cwd=None):
        return subprocess.run(
            [sys.executable, "-m", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=600,
        )

    listing = run("shardplug", "strategies", "--json")
    rows = {r["name"]: r for r in json.loads(listing.stdout)}
    assert rows["megatron"]["source"] == "shardplug-megatron 0.1.0"
    assert rows["megatron"]["description"].startswith("Tensor parallel")

    train = run(
        "shardplug", "train", "--strategy", "megatron", "--model", "mlp", "--steps", "5", "--quiet"
    )
    assert train.returncode == 0, train.stderr
    assert "with megatron on 8 cpu devices (model=8, auto axes)" in train.stdout

    tests = run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "test_megatron.py",
        "--shardplug-models=mlp,cnn",
        "-rs",
        cwd=project,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "tensor parallelism gives every device the whole batch" in tests.stdout
    assert re.search(r"\d+ passed, 1 skipped", tests.stdout), tests.stdout
    assert (
        "[megatron-mlp]"
        in run(
            "pytest",
            "-q",
            "--collect-only",
            "-p",
            "no:cacheprovider",
            "test_megatron.py",
            cwd=project,
        ).stdout
    )
