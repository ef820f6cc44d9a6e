"""The operator's rooms import downwards only (docs/internals.md): glue → runtime → status → builders →
schema, with ``settings`` and ``kube`` below every room and the command (``cli``, ``dry_run``) above."""

from __future__ import annotations

import ast
from pathlib import Path

import diloco_operator

PACKAGE = Path(diloco_operator.__file__).parent
# each part of the operator, and how high it stands: a module imports only parts of its height or lower
HEIGHT = {"settings": 0, "kube": 0, "schema": 1, "builders": 2, "status": 3, "runtime": 4, "glue": 5,
          "dry_run": 6, "cli": 7}  # fmt: skip


def _part(module: str) -> str:
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco_operator."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("diloco_operator.")}
    return found


def test_every_part_of_the_operator_has_a_place() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert modules | rooms == set(HEIGHT), "a new room or module: give it a height in HEIGHT"


def test_rooms_import_only_downwards() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("diloco_operator", *path.relative_to(PACKAGE).with_suffix("").parts))
        if module.endswith("__init__"):
            continue
        for imported in _imports(path):
            if HEIGHT[_part(imported)] > HEIGHT[_part(module)]:
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_the_rule_is_checked_on_real_imports() -> None:
    # the passes import the status, the status imports the builders: both are allowed, and seen
    passes = _imports(PACKAGE / "runtime" / "passes.py")
    assert any(_part(m) == "status" for m in passes)
    assert any(_part(m) == "builders" for m in _imports(PACKAGE / "status" / "export.py"))
