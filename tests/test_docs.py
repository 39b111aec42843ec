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
