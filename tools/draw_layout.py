"""Draw matepoint-core's layout, read from its imports, for docs/how-it-works.md.

The picture is computed, not drawn by hand: every ``import`` and ``from ... import`` in
``packages/matepoint-core/src/matepoint`` (function-level ones included) is an arrow, each
subpackage (a wing: ``_engine``, ``_planner``, ``_compiled``) counts as one module, and a
module's floor is one above the highest module it imports (floor 0 imports nothing of core).
Run from the repository root with matplotlib installed:

    python tools/draw_layout.py           # writes docs/img/core-layout.svg and the floor table
    python tools/draw_layout.py --check   # exits 1 if the docs no longer match the code

It rewrites the block between the ``layout:begin`` and ``layout:end`` markers of
docs/how-it-works.md. The output is deterministic (fixed SVG ids, no date).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "packages" / "matepoint-core" / "src" / "matepoint"
DOC = ROOT / "docs" / "how-it-works.md"
IMAGE = ROOT / "docs" / "img" / "core-layout.svg"
BEGIN, END = "<!-- layout:begin -->", "<!-- layout:end -->"
PACKAGE = "matepoint"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The package root's modules (each subpackage one of them) and the imports between them.

    Attributes:
        nodes: Dotted names: ``matepoint`` (the package's ``__init__``), root modules such as
            ``matepoint._checkpoint``, and subpackages such as ``matepoint._engine``.
        edges: ``(importer, imported)`` pairs between different nodes.
        members: Per subpackage, its modules' names, in file order.
        cycles: Every import cycle found, each as the nodes on it.
    """

    nodes: tuple[str, ...]
    edges: frozenset[tuple[str, str]]
    members: dict[str, tuple[str, ...]]
    cycles: tuple[tuple[str, ...], ...]

    def floors(self) -> dict[str, int]:
        """Each node's floor: 0 without core imports, else one above its highest import."""
        floors: dict[str, int] = {}

        def floor(node: str, path: tuple[str, ...]) -> int:
            if node not in floors:
                below = [
                    floor(imported, (*path, node))
                    for importer, imported in self.edges
                    if importer == node and imported not in path
                ]
                floors[node] = 1 + max(below) if below else 0
            return floors[node]

        for node in self.nodes:
            floor(node, ())
        return floors


def _node_of(module: str, subpackages: set[str]) -> str | None:
    """The layout node a dotted module name belongs to, or None outside the package."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return PACKAGE
    head = f"{PACKAGE}.{parts[1]}"
    return head if parts[1] in subpackages or len(parts) == 2 else None


def _imports(path: Path) -> Iterator[str]:
    """Every module name ``path`` imports (``from matepoint import x`` yields ``matepoint.x``)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _module_name(path: Path, core: Path) -> str:
    parts = path.relative_to(core.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(nodes: tuple[str, ...], edges: frozenset[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Each import cycle, found by a depth-first walk from every node."""
    found: set[tuple[str, ...]] = set()

    def walk(node: str, path: tuple[str, ...]) -> None:
        for importer, imported in sorted(edges):
            if importer != node:
                continue
            if imported in path:
                cycle = path[path.index(imported) :]
                start = cycle.index(min(cycle))
                found.add(cycle[start:] + cycle[:start])
            else:
                walk(imported, (*path, imported))

    for node in nodes:
        walk(node, (node,))
    return sorted(found)


def read_layout(core: Path = CORE) -> Layout:
    """Read the layout from the source under ``core``."""
    subpackages = {path.parent.name for path in core.glob("*/__init__.py")}
    files = sorted(core.rglob("*.py"))
    nodes: dict[str, None] = {}
    members: dict[str, list[str]] = {f"{PACKAGE}.{name}": [] for name in sorted(subpackages)}
    edges: set[tuple[str, str]] = set()
    for path in files:
        module = _module_name(path, core)
        importer = _node_of(module, subpackages)
        if importer is None:
            continue
        nodes[importer] = None
        if importer in members and module != importer:
            members[importer].append(module.rsplit(".", 1)[1])
        for name in _imports(path):
            imported = _node_of(name, subpackages)
            if imported is not None and imported != importer and imported != PACKAGE:
                edges.add((importer, imported))
    # A name imported from a module (``from matepoint._engine.saving import pack``) is no node.
    known = frozenset(edge for edge in edges if edge[1] in nodes)
    ordered = tuple(sorted(nodes))
    return Layout(
        ordered,
        known,
        {name: tuple(modules) for name, modules in members.items()},
        tuple(_cycles(ordered, known)),
    )


def _short(node: str) -> str:
    """A node's name within the package; the package's own ``__init__`` is the front door."""
    return "__init__" if node == PACKAGE else node.split(".", 1)[1]


def floor_table(layout: Layout) -> str:
    """The layout as a Markdown table: each floor, its modules (a subpackage with its own)."""
    floors = layout.floors()
    rows = ["| floor | modules (a subpackage counts as one) |", "| ---: | --- |"]
    for level in sorted(set(floors.values()), reverse=True):
        names = []
        for node in sorted(node for node, value in floors.items() if value == level):
            inside = layout.members.get(node)
            names.append(
                f"`{_short(node)}` ({', '.join(inside)})" if inside else f"`{_short(node)}`"
            )
        rows.append(f"| {level} | {'; '.join(names)} |")
    return "\n".join(rows)


def doc_block(layout: Layout) -> str:
    """The generated block of docs/how-it-works.md, markers included."""
    floors = layout.floors()
    summary = (
        f"{len(layout.nodes)} modules on {max(floors.values()) + 1} floors, "
        f"{len(layout.cycles)} import cycles."
    )
    return "\n".join(
        [
            BEGIN,
            "<!-- generated by tools/draw_layout.py from the imports; do not edit -->",
            "",
            "![matepoint-core's modules by floor, arrows for imports](img/core-layout.svg)",
            "",
            summary,
            "",
            floor_table(layout),
            END,
        ]
    )


def draw(layout: Layout, path: Path) -> None:
    """Draw the layout as an SVG: one row per floor, arrows from importer to imported."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "matepoint-layout"})
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    floors = layout.floors()
    levels = sorted(set(floors.values()))
    rows = {
        level: sorted(node for node in layout.nodes if floors[node] == level) for level in levels
    }
    width = max(len(row) for row in rows.values())
    figure = Figure(figsize=(2.2 * width + 1, 1.6 * len(levels) + 0.6))
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(-0.6, width - 0.4)
    axes.set_ylim(-0.6, len(levels) - 0.2)
    axes.axis("off")
    where: dict[str, tuple[float, float]] = {}
    for level, row in rows.items():
        offset = (width - len(row)) / 2
        for index, node in enumerate(row):
            where[node] = (offset + index, float(level))
    lines = {
        node: textwrap.wrap(", ".join(layout.members[node]), width=30)
        if node in layout.members
        else []
        for node in layout.nodes
    }
    half = {node: 0.14 + 0.075 * len(wrapped) for node, wrapped in lines.items()}
    for importer, imported in sorted(layout.edges):
        (x0, y0), (x1, y1) = where[importer], where[imported]
        axes.annotate(
            "",
            xy=(x1, y1 + half[imported] + 0.02),
            xytext=(x0, y0 - half[importer] - 0.02),
            arrowprops={"arrowstyle": "->", "color": "#888888", "lw": 0.7, "alpha": 0.6},
        )
    for node, (x, y) in where.items():
        color = "#d9e7f5" if node in layout.members else "#f2f2f2"
        axes.add_patch(
            FancyBboxPatch(
                (x - 0.45, y - half[node]),
                0.9,
                2 * half[node],
                boxstyle="round,pad=0.02",
                fc=color,
                ec="#333",
            )
        )
        label = "\n".join([_short(node), *lines[node]])
        axes.text(x, y, label, ha="center", va="center", fontsize=7, linespacing=1.3)
    for level in levels:
        axes.text(-0.58, level, f"floor {level}", ha="left", va="center", fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="svg", metadata={"Date": None})


def updated_doc(layout: Layout, text: str) -> str:
    """``text`` (docs/how-it-works.md) with its generated block replaced."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + doc_block(layout) + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the docs are out of date")
    args = parser.parse_args(argv)
    layout = read_layout()
    text = DOC.read_text(encoding="utf-8")
    if args.check:
        if updated_doc(layout, text) != text or not IMAGE.exists():
            print("docs/how-it-works.md's layout is out of date: run tools/draw_layout.py")
            return 1
        return 0
    DOC.write_text(updated_doc(layout, text), encoding="utf-8")
    draw(layout, IMAGE)
    print(f"wrote {IMAGE.relative_to(ROOT)} and the layout block of {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
