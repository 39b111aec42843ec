"""Every ``python`` block in the README and docs/ runs, in order, one namespace per page."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# docs/plugins.md builds a whole package from its blocks: tests/test_plugin_guide.py runs it.
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "plugins.md"),
]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_blocks_run(page, capsys):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    assert blocks or page.name == "architecture.md"


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
    assert len(specs) == 18


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
