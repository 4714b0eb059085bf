"""matepoint-core's layout: a front door and two wings, imports running one way.

The layout is read from the source by ``tools/draw_layout.py``, the same code that draws it in
docs/how-it-works.md, so the picture there and these checks cannot disagree.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPOSITORY = Path(__file__).resolve().parents[3]
CORE = REPOSITORY / "packages" / "matepoint-core" / "src" / "matepoint"
# The most floors the package root may stack (a subpackage counts as one module).
MAX_FLOORS = 6
# The longest function core may hold, its docstring included (def line to last line).
MAX_FUNCTION_LINES = 80


@pytest.fixture(scope="module")
def draw_layout() -> ModuleType:
    path = REPOSITORY / "tools" / "draw_layout.py"
    spec = importlib.util.spec_from_file_location("draw_layout", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("draw_layout", module)
    spec.loader.exec_module(module)
    return module


def test_the_package_root_has_few_floors_and_no_cycles(draw_layout: ModuleType) -> None:
    layout = draw_layout.read_layout(CORE)
    floors = layout.floors()
    assert layout.cycles == ()
    assert max(floors.values()) + 1 <= MAX_FLOORS, floors
    # Every arrow points down a floor: what the floors mean.
    assert all(floors[importer] > floors[imported] for importer, imported in layout.edges)


def test_the_two_wings_are_subpackages_and_the_engine_never_imports_the_planner(
    draw_layout: ModuleType,
) -> None:
    layout = draw_layout.read_layout(CORE)
    assert {"matepoint._engine", "matepoint._planner"} <= set(layout.members)
    assert ("matepoint._engine", "matepoint._planner") not in layout.edges
    modules = [node.rsplit(".", 1)[-1] for node in layout.nodes if node not in layout.members]
    assert not [name for name in modules if re.match(r"_(plan|budget)", name)]


def test_the_layout_in_the_docs_is_the_layout_of_the_code(draw_layout: ModuleType) -> None:
    text = (REPOSITORY / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    layout = draw_layout.read_layout(CORE)
    assert draw_layout.updated_doc(layout, text) == text, "run python tools/draw_layout.py"
    assert (REPOSITORY / "docs" / "img" / "core-layout.svg").exists()


def test_a_cycle_is_found(draw_layout: ModuleType, tmp_path: Path) -> None:
    """The checks above can fail: two modules importing each other make a cycle."""
    package = tmp_path / "matepoint"
    package.mkdir()
    (package / "__init__.py").write_text("from matepoint import _a\n")
    (package / "_a.py").write_text("from matepoint._b import x\n")
    (package / "_b.py").write_text("def f():\n    from matepoint._a import y\n")
    layout = draw_layout.read_layout(package)
    assert layout.cycles == (("matepoint._a", "matepoint._b"),)


def test_no_function_in_core_is_longer_than_the_limit() -> None:
    long = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(CORE)}:{node.name} ({lines} lines)")
    assert not long


def test_the_time_model_is_defined_in_one_module() -> None:
    """DeviceModel and the default rates live in the time model alone."""
    defining = {
        path.relative_to(CORE).as_posix()
        for path in CORE.rglob("*.py")
        if re.search(
            r"^class DeviceModel\b|^DEFAULT_\w+ = |\b989e12\b|\b55e9\b",
            path.read_text(encoding="utf-8"),
            flags=re.MULTILINE,
        )
    }
    assert defining == {"_planner/time_model.py"}
