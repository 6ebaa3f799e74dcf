"""Only the cache core changes a node's state: no Python module of kvtier outside
manager/core/ writes a node's `flags` (`kvtier.manager.core.nodes` has the state diagram;
clients ask `CacheCore` for a named transition instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("manager", "worker", "admin", "engine", "integrations")  # kvtier.<name>
CORE = ROOT / "manager" / "core"


def flag_writes(source: str, filename: str = "<source>") -> list[int]:
    """Line numbers where `source` writes an attribute named `flags`: an assignment (plain,
    augmented, annotated, or inside a tuple / starred target), a `del`, or
    `setattr(obj, "flags", ...)`."""
    lines: list[int] = []

    def targets(t: ast.expr) -> None:
        if isinstance(t, ast.Attribute) and t.attr == "flags":
            lines.append(t.lineno)
        elif isinstance(t, ast.Tuple | ast.List):
            for e in t.elts:
                targets(e)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                targets(t)
        elif isinstance(node, ast.NamedExpr):
            targets(node.target)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "flags"):
            lines.append(node.lineno)
    return lines


def kvtier_modules() -> list[Path]:
    out: list[Path] = []
    for pkg in PACKAGES:
        out += sorted((ROOT / pkg).rglob("*.py"))
    return out


@pytest.mark.parametrize("snippet", [
    "node.flags = 0",
    "node.flags |= 4",
    "node.flags &= ~4",
    "a, node.flags = 1, 2",
    "node.flags: int = 0",
    "setattr(node, 'flags', 3)",
    "for n in nodes:\n    n.flags ^= 1",
])
def test_scanner_finds_writes(snippet: str) -> None:
    assert flag_writes(snippet), snippet


def test_scanner_ignores_reads() -> None:
    assert not flag_writes("x = node.flags & 4\nif node.flags:\n    f(node.flags)\n")


def test_no_flags_written_outside_the_core() -> None:
    modules = kvtier_modules()
    assert any(p.is_relative_to(CORE) for p in modules), "the core was not scanned"
    assert len(modules) > 30, f"only {len(modules)} modules found under {ROOT}"
    offenders = [f"{p.relative_to(ROOT)}:{line}"
                 for p in modules if not p.is_relative_to(CORE)
                 for line in flag_writes(p.read_text(), str(p))]
    assert not offenders, (
        "node flags written outside manager/core/ (ask CacheCore for a named transition): "
        + ", ".join(offenders))


def test_the_core_does_write_flags() -> None:
    """The scan reads real code: the core's transitions are found where they are (`CacheCore`
    in cache.py and the families of transitions it inherits, one module each)."""
    writes = {p.name: len(flag_writes(p.read_text(), str(p))) for p in CORE.glob("*.py")}
    for family in ("cache.py", "engine_io.py", "storage_io.py", "recovery.py"):
        assert writes.get(family, 0) >= 1, f"no flag write found in {family}: {writes}"
    assert sum(writes.values()) >= 20, writes
