"""Every import runs downhill (docs/layout.md): a module imports only parts below its own,
or modules of its own part without a circle; kernels/ imports nothing of ours; the
operator imports nothing of the runtime. Lazy imports inside functions count too."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"shoal": "shoal", "shoal.runtime": "runtime", "shoal.kernels": "kernels", "shoal.operator": "operator"}

# part -> level; a module may import parts of a lower level (docs/layout.md has the same table)
LEVELS = {
    "shoal.runtime.cli": 10,
    "shoal.runtime.bench": 8, "shoal.runtime.router": 8,
    "shoal.runtime.entrypoints": 7,
    "shoal.runtime.engine": 6,
    "shoal.runtime.executor": 5, "shoal.runtime.cache": 5,
    "shoal.runtime.models": 4,
    "shoal.runtime.layers": 3,
    "shoal.runtime.config": 2, "shoal.runtime.distributed": 2, "shoal.runtime.cpu_memory": 2, "shoal.runtime.cpu_threads": 2,
    "shoal.runtime.sampling_params": 2, "shoal.runtime.metrics": 2,
    "shoal.kernels": 1,
}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shoal")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shoal"):
            for a in node.names:  # `from pkg import module` imports the module, else the package
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Call) and _dynamic_import(node):  # __import__("shoal.x"), import_module("shoal.x")
            found.add(node.args[0].value)
    return found


def _dynamic_import(call: ast.Call) -> bool:
    name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
    return (name in ("__import__", "import_module") and bool(call.args) and isinstance(call.args[0], ast.Constant)
            and str(call.args[0].value).startswith("shoal"))


def part_of(module: str) -> str | None:
    best = None
    for part in LEVELS:
        if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
            best = part
    return best


MODULES = modules()
GRAPH = {m: {i for i in imports_of(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_every_runtime_module_has_a_part():
    loose = [m for m in MODULES if m.startswith("shoal.runtime.") and part_of(m) is None]
    assert not loose, f"give these a level in LEVELS and docs/layout.md: {loose}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part_of(m)))
def test_imports_run_downhill(module):
    part = part_of(module)
    uphill = [i for i in GRAPH[module] if part_of(i) and part_of(i) != part and LEVELS[part_of(i)] >= LEVELS[part]
              and i != part_of(i).rsplit(".", 1)[0]]
    assert not uphill, f"{module} ({part}, level {LEVELS[part]}) imports uphill or sideways: {uphill}"


def test_kernels_and_operator_stand_alone():
    for module, deps in GRAPH.items():
        if module.startswith("shoal.kernels"):
            assert all(d.startswith("shoal.kernels") for d in deps), (module, deps)
        if module.startswith("shoal.operator"):
            assert not any(d.startswith(("shoal.runtime", "shoal.kernels")) for d in deps), (module, deps)


def test_no_import_circles():
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in GRAPH[m]:
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d] if d in path else [m, d]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_dynamic_imports_are_seen(tmp_path):
    """`__import__` and `importlib.import_module` with a literal name count as imports."""
    src = tmp_path / "m.py"
    src.write_text("import importlib\n"
                   "def f():\n    return __import__('shoal.runtime.cli', fromlist=['main'])\n"
                   "def g():\n    return importlib.import_module('shoal.runtime.engine.engine')\n")
    assert imports_of(src) == {"shoal.runtime.cli", "shoal.runtime.engine.engine"}


def _layout_rows() -> dict[str, int]:
    """docs/layout.md's table as {module or package: level}; files in a row that name no folder
    sit beside the row's first one (`runtime/config.py`, `distributed.py`)."""
    import re

    rows = {}
    for line in (REPO / "docs" / "layout.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        paths = re.findall(r"`([^`]+)`", cells[2])
        base = paths[0].rstrip("/").rsplit("/", 1)[0]
        for path in paths:
            full = path if "/" in path else f"{base}/{path}"
            assert (REPO / full).exists(), f"docs/layout.md names {full}, which does not exist"
            folder, _, rest = full.rstrip("/").partition("/")
            package = {v: k for k, v in FOLDERS.items()}[folder]
            parts = Path(rest).with_suffix("").parts if rest else ()
            rows[".".join([package, *parts])] = int(cells[0])
    return rows


def test_layout_doc_matches_the_levels():
    assert _layout_rows() == LEVELS
