"""The shape of the production code: ``# fmt: skip`` only where a table reads better, modules of at most
400 lines and functions of at most 80."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("core", "worker", "synchronizer", "operator", "diloco", "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
TABLES = (ast.Dict, ast.List, ast.Tuple, ast.Set)


def _sources() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), path.read_text())
        for folder in PRODUCTION
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def test_fmt_skip_only_ends_a_table() -> None:
    misplaced = []
    for path, text in _sources():
        tables = {
            node.end_lineno
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, TABLES)
        }
        misplaced += [
            f"{path}:{n}"
            for n, line in enumerate(text.splitlines(), start=1)
            if "# fmt: skip" in line and n not in tables
        ]
    assert misplaced == [], "let the formatter lay these out (a `# fmt: skip` is for a table literal)"


def test_modules_fit() -> None:
    too_large = {p: n for p, text in _sources() if (n := len(text.splitlines())) > MAX_MODULE_LINES}
    assert too_large == {}, f"split these modules (at most {MAX_MODULE_LINES} lines)"


def test_functions_fit() -> None:
    too_long = {}
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{path}:{node.name}"] = n
    assert too_long == {}, f"split these functions (at most {MAX_FUNCTION_LINES} lines)"
