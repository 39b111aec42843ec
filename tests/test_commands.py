"""Every ``shardplug`` command the README and docs/ show runs, in page order, in a folder of
its own: as written, but shortened where it would train long (``--steps`` 2, then 3 where
it resumes; checkpoints every step; bench one round of 2 steps; recommend over three
strategies), or is named in :data:`NOT_RUN` with the reason it cannot run here."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from shardplug.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)

#: commands (by a fragment of their text) that are not run, and why
NOT_RUN = {
    "pip install -e '.[cuda]'": "needs NVIDIA GPUs",
    "launch --nprocs": "starts processes: tests/test_distributed.py launches them",
    "--coordinator 10.0.0.1": "joins hosts that are not here",
    "--distributed": "started by SLURM's srun on hosts that are not here",
    "--strategy megatron": "the plugin guide's package: tests/test_plugin_guide.py runs it",
    "--init-from DIR": "DIR stands for the user's checkpoint",
    "--init-from path/to/": "a placeholder path for the user's checkpoint",
    "--longest-sequence": "plans a 7B model at ever longer sequences for minutes; "
    "tests/test_bad_input.py checks the search's bounds",
    **({} if PLUGIN else {"--target": "needs JAX's CUDA plugin: CI runs tests/test_targets.py "
                                      "with it"}),
}  # fmt: skip


def commands(page: Path) -> list[str]:
    """The ``shardplug`` commands of a page's shell blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            if "shardplug " in line and not line.startswith("#"):
                found.append("shardplug " + line.split("shardplug ", 1)[1])
    return found


def shortened(words: list[str]) -> list[str]:
    """A command's arguments as the test runs them (see the module)."""
    out, skip = [], False
    warmup = int(words[words.index("--warmup") + 1]) if "--warmup" in words else 0
    least = str(max(2, warmup + 2))  # a schedule's decay ends after its warmup
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in ("--steps", "--checkpoint-every", "--rounds") and i + 1 < len(words):
            value = {"--steps": "3" if "--resume" in words else least,
                     "--checkpoint-every": "1", "--rounds": "1"}[word]  # fmt: skip
            out += [word, value]
            skip = True
            continue
        out.append(word)
    command = out[0] if out else ""
    if command == "train" and "--steps" not in out:
        out += ["--steps", "6" if "--profile" in out else least]
    if command == "bench" and "--rounds" not in out:
        out += ["--rounds", "1"]
    if command == "recommend" and "--strategies" not in out:
        out += ["--strategies", "dp,fsdp,2d"]
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.name)
def test_every_command_runs(page, tmp_path, monkeypatch, capsys):
    for name in ("examples", "tests", "benchmarks"):  # the pages' paths, from the root
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    ran = skipped = 0
    for text in commands(page):
        if any(fragment in text for fragment in NOT_RUN):
            skipped += 1
            continue
        args = shortened(shlex.split(text)[1:])
        code = main(args)
        said = capsys.readouterr().err.strip().splitlines()
        assert code == 0, f"{page.name}: {' '.join(args)} exited {code}: {said[-3:]}"
        ran += 1
    assert ran + skipped == len(commands(page))
