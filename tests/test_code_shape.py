"""The shape of the production code: ``# fmt: skip`` only where a table reads better, modules of at most
400 lines and functions of at most 80. The modules and functions above those sizes today are listed
with their present size: they may shrink, not grow, and leave the list once they fit."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("core", "worker", "synchronizer", "operator", "diloco", "bench")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
TABLES = (ast.Dict, ast.List, ast.Tuple, ast.Set)

# path -> its lines today
LARGE_MODULES = {
    "synchronizer/diloco_sync/fragment_state.py": 526,
    "bench/diloco_bench/attack.py": 537,
    "worker/diloco_worker/session.py": 515,
    "worker/diloco_worker/anchors.py": 466,
    "bench/diloco_bench/operator_scale.py": 459,
    "core/diloco_core/codec.py": 435,
    "synchronizer/diloco_sync/connections.py": 427,
    "core/diloco_core/flags.py": 412,
}
# path:function -> its lines today
LONG_FUNCTIONS = {
    "bench/diloco_bench/attack.py:continuations": 118,
    "bench/diloco_bench/operator_scale.py:run_once": 118,
    "worker/diloco_worker/learner.py:_run": 89,
    "synchronizer/diloco_sync/app.py:create_app": 92,
}


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


def test_modules_fit_or_do_not_grow() -> None:
    sizes = {path: len(text.splitlines()) for path, text in _sources()}
    too_large = {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES and n > LARGE_MODULES.get(p, 0)}
    assert too_large == {}, f"split these modules (at most {MAX_MODULE_LINES} lines)"
    fitting = [p for p, n in LARGE_MODULES.items() if sizes.get(p, 0) <= MAX_MODULE_LINES]
    assert fitting == [], "these fit now: take them out of LARGE_MODULES"


def test_functions_fit_or_do_not_grow() -> None:
    lengths = {}
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{path}:{node.name}"] = max(
                    lengths.get(f"{path}:{node.name}", 0), node.end_lineno - node.lineno + 1
                )
    too_long = {f: n for f, n in lengths.items() if n > MAX_FUNCTION_LINES and n > LONG_FUNCTIONS.get(f, 0)}
    assert too_long == {}, f"split these functions (at most {MAX_FUNCTION_LINES} lines)"
    fitting = [f for f, n in LONG_FUNCTIONS.items() if lengths.get(f, 0) <= MAX_FUNCTION_LINES]
    assert fitting == [], "these fit now: take them out of LONG_FUNCTIONS"
