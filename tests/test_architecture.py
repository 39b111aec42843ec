"""The layers stay as docs/architecture.md draws them, and no module grows past reading."""

import ast
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


#: the modules that may pass the cap, by name, each with the reason
LONG = {
    "core/hookspecs.py": "the contract is documentation: every hook with its example, grouped "
    "by the phase of a run that calls it, in one module (split by a line cap, it was split "
    "by no concept)",
}


def test_no_module_is_over_500_lines():
    long = {
        str(path.relative_to(SRC)): n
        for path in SRC.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not {m: n for m, n in long.items() if m not in LONG}, f"split these modules: {long}"
    assert set(LONG) <= {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}, "LONG is stale"


def test_the_trainer_is_a_facade_of_at_most_300_lines():
    """The Trainer hands its work to the layout, the settings and the loop (its module's
    docstring): what grows belongs there."""
    assert len((SRC / "trainer.py").read_text().splitlines()) <= 300


def test_core_names_no_parallelisms_operation_even_in_comments():
    """An operation one parallelism brings (an expert-parallel ragged product, a pipeline's
    send) is named in that parallelism's code; core's comments speak of operations in
    general. The FLOP count counts every product primitive by name, a grouped product's too
    (a mixture of experts' on one device is one)."""
    found = [f"{p.relative_to(SRC)}:{n}" for p in sorted((SRC / "core").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "ragged_dot" in line and p.name != "flops.py"]  # fmt: skip
    assert not found, found


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path``'s import statements name, wherever they
    stand: at the top, under ``if TYPE_CHECKING:``, inside a function. ``from a import b``
    names the module ``a.b`` where there is one, else ``a`` (a package whose ``__init__``
    gathers its submodules is no cycle with a submodule imported through it)."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
            if not set(names) <= modules:  # names of the package itself, not only submodules
                names.append(base)
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def test_no_import_cycle():
    """No two modules of src import each other, through any number of others. Every import
    statement counts, wherever it stands: one under ``if TYPE_CHECKING:`` or inside a
    function is as much a dependency as one at the top (moving an import there hides a
    cycle; it does not break one). Tarjan's strongly connected components of the graph."""
    paths = {_module(p): p for p in SRC.rglob("*.py")}
    graph = {m: _imported(p, set(paths)) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1:
                ties = [f"{a} -> {b}" for a in component for b in graph[a] if b in component]
                cycles.append("; ".join(sorted(ties)))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, "import cycles: " + " | ".join(cycles)


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
    """Core is the contract, the composition, the traced step and the mesh utilities: its
    code names no built-in parallelism and no axis of theirs. Its code: the names it defines
    and uses and its strings, read with ast; not its docstrings nor its comments, which may
    explain with the built-ins' names (RANK, in shardplug.plugin, states the axes once)."""
    from shardplug.plugin import RANK

    words = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, BUILT_IN)) + r")(?![\w-])")
    # the one exception, by name: a run without a strategy is data parallel, on core's
    # fallback mesh of one axis
    allowed = {("core/fallbacks.py", "AXIS")}
    found = []
    for path in sorted((SRC / "core").rglob("*.py")):
        name = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text())
        text = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and (name, t.id) in allowed for t in node.targets
            ):
                text.add(id(node.value))
        for node in ast.walk(tree):
            named = [
                getattr(node, field, None)
                for field in ("id", "attr", "name", "arg", "asname", "module")
            ]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in text:
                    continue
                if node.value in RANK:
                    found.append(f"{name}:{node.lineno}: {node.value!r}")
                named.append(node.value)
            for word in named:
                if isinstance(word, str):
                    found += [f"{name}:{node.lineno}: {m}" for m in words.findall(word)]
    assert not found, "\n".join(sorted(set(found)))


def test_the_declared_floors_are_the_versions_ci_tests():
    """pyproject.toml's lower bound of each package .ci/floor.txt pins is that pin: CI
    installs the floors on Python 3.11 and runs on them the tests of what rests on their APIs
    (.ci/run)."""
    root = SRC.parent.parent
    pins = dict(re.findall(r"^([\w.-]+)==([\w.]+)$", (root / ".ci/floor.txt").read_text(), re.M))
    assert {"jax", "flax", "optax", "equinox", "orbax-checkpoint", "qwix"} <= pins.keys()
    text = (root / "pyproject.toml").read_text()
    declared = dict(re.findall(r'"([\w.-]+)(?:\[\w,]*\])?>=([\w.]+)"', text))
    for name, version in pins.items():
        if name != "jaxlib":  # jax pins its jaxlib
            assert declared[name] == version, name


#: the facade and what every layer shares: the top level holds these and folders, each
#: folder one purpose (its ``__init__`` says which, and what it may import)
TOP = {"__init__.py", "__main__.py", "_lazy.py", "_moved.py", "builtin_tasks.py", "errors.py",
       "layout.py", "settings.py", "stack.py", "task.py", "trainer.py"}  # fmt: skip


def test_the_top_level_is_the_facade_and_folders_by_purpose():
    """A new capability lands in the folder of its purpose, not beside the facade; and every
    folder says in its docstring what lives there and what it may import."""
    assert {p.name for p in SRC.glob("*.py")} == TOP
    for folder in [p for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.relative_to(SRC)} is no package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing"


MOVED_CHECK = """
import sys, warnings
import shardplug
from shardplug._moved import MOVED
found = []
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"import {old} as was")  # the path the docs showed
        exec(f"import {old} as again")  # a second import says nothing
        exec(f"import {new} as now")
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert was is now is again, old
    assert len(said) == 1 and new in said[0], (old, said)
print(len(MOVED))
"""


def test_a_moved_module_still_imports_by_its_old_path_warning_once():
    """``from shardplug.explain import explain`` and ``shardplug.core.targets`` (and each of
    the others moved) give the very module at the new path, with one FutureWarning naming
    it; the run of an old path imports no module twice."""
    done = subprocess.run([sys.executable, "-c", MOVED_CHECK], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 40


def test_no_strategy_is_named_outside_its_plugin():
    """Nothing under src/ but the plugins picks a strategy by its name, the command line
    included: the default, bench's and the conformance suite's one-device reference are the
    plainest strategy found by what it does (``plain_strategy``). Read with ast: a string
    of the code that is a built-in's name or a composition of them; docstrings and help
    text may name them. ``plugin/`` states the axes' ranks once (RANK names the fsdp axis)."""
    from shardplug.core.registry import plain_strategy

    named = re.compile(r"(" + "|".join(map(re.escape, BUILT_IN)) + r")(\+(" +
                       "|".join(map(re.escape, BUILT_IN)) + r"))*")  # fmt: skip
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC))
        if name.startswith(("strategies/", "plugin/")):
            continue
        tree = ast.parse(path.read_text())
        text = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in text and named.fullmatch(node.value)):  # fmt: skip
                found.append(f"{name}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)
    assert plain_strategy() == "dp"  # found by what it does: its one hook, a batch axis


def test_an_old_paths_module_keeps_its_own_spec():
    """After an import by its old path, the module's spec is still its own (``reload`` and
    ``importlib.util.find_spec`` read it)."""
    code = ("import importlib, warnings; warnings.simplefilter('ignore'); "
            "import shardplug.units as old; import shardplug.core.units as new; "
            "assert old is new and new.__spec__.name == 'shardplug.core.units', new.__spec__; "
            "importlib.reload(new); print(new.__name__)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "shardplug.core.units", done.stderr
