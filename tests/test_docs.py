"""Every ``python`` block in the README and docs/ runs, in order, one namespace per page."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# docs/plugins.md's blocks of a file (```python file=...) make a whole package, which
# tests/test_plugin_guide.py installs and runs; its plain blocks run here, as every page's.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_blocks_run(page, capsys):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    assert blocks or page.name == "architecture.md"


#: names the pages write that are entry-point groups, not attributes
GROUPS = {"shardplug.addons", "shardplug.schedules"}

DOTTED = """
import importlib, pkgutil, sys

import shardplug

assert "jax" not in sys.modules, "import shardplug imported JAX"
shardplug.stack.scan  # the issue's: before anything else has imported shardplug.stack
assert not hasattr(shardplug, "no_such_name")
modules = {m.name for m in pkgutil.iter_modules(shardplug.__path__)}
assert not modules & set(shardplug.__all__), "an export shares a submodule's name"
failed = []
for name in sys.argv[1:]:  # each from a fresh shardplug, so none is found by another's import
    for loaded in [m for m in sys.modules if m.split(".")[0] == "shardplug"]:
        del sys.modules[loaded]
    found = importlib.import_module("shardplug")
    try:
        for part in name.split(".")[1:]:
            found = getattr(found, part)
    except AttributeError as exc:
        failed.append(f"{name}: {exc}")
assert not failed, failed
"""


def test_every_dotted_name_the_pages_write_works_after_import_shardplug():
    """``shardplug.stack.scan``, ``shardplug.running.data.Batches``,
    ``shardplug.core.compiled.hlo...``: as the README and docs write them, after a plain
    ``import shardplug`` in a fresh interpreter."""
    names = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        names |= set(re.findall(r"\bshardplug(?:\.[A-Za-z_]\w*)+", page.read_text()))
    names -= GROUPS
    assert {"shardplug.stack", "shardplug.moe.routed_experts",
            "shardplug.core.compiled.hlo.partitioned_hlo", "shardplug.plugin.RANK",
            "shardplug.running.data.Batches"} <= names  # fmt: skip
    code = [sys.executable, "-c", DOTTED, *sorted(names)]
    done = subprocess.run(code, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_architecture_page_names_every_hook_there_is():
    """The hook list in docs/architecture.md is the one in core/hookspecs.py (it drifted)."""
    from shardplug.core import hookspecs

    specs = {
        name for name, value in vars(hookspecs).items()
        if callable(value) and hasattr(value, f"{hookspecs.PROJECT}_spec")
    }  # fmt: skip
    text = (ROOT / "docs" / "architecture.md").read_text()
    bullet = text[text.index("- **`core/hookspecs.py`**") :].split("\n- ", 1)[0]
    assert set(re.findall(r"`(\w+)`", bullet)) - {"firstresult"} == specs
    assert len(specs) == 20  # trace_context, which nothing implemented, is gone; memory: 2;
    # held_weights: an add-on's products (float8's)


def test_the_newcomers_tour_names_files_that_exist():
    """Every file the tour in docs/architecture.md walks through is a module of shardplug."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tour = text.split("## A newcomer's tour", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\*\*`([\w/]+\.py)`\*\*", tour)
    assert len(named) >= 15
    missing = [f for f in named if not (ROOT / "src" / "shardplug" / f).is_file()]
    assert not missing, f"the tour names files that do not exist: {missing}"


def test_the_docs_state_the_axes_order_as_the_code_ranks_them():
    """Wherever the README or docs/ list the axes in order (four or more, backticked), the
    list is the mesh order shardplug.plugin.RANK states, or the claim order (its reverse),
    whole: it had drifted to "model, stage, fsdp, data" in seven places."""
    from shardplug.plugin import RANK

    mesh = sorted(RANK, key=RANK.get)
    name = "|".join(RANK)
    run = re.compile(rf"`(?:{name})`(?:,\s+(?:and\s+)?`(?:{name})`){{3,}}")
    found = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for listed in run.findall(page.read_text()):
            axes = re.findall(r"`(\w+)`", listed)
            assert axes in (mesh, mesh[::-1]), f"{page.name}: {listed!r}"
            found += 1
    assert found >= 4
