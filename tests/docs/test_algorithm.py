"""docs/algorithm.md: every section the code and the docs cite exists, and every module, class and
function the page names exists in the code."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "algorithm.md"
# "algorithm.md §3.4" and "algorithm.md §2.4, §3.11": each "§N" after the page's name
_CITATION = re.compile(r"algorithm\.md\)?((?:,?\s*§\d+(?:\.\d+)*)+)")
_HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
_DOTTED = re.compile(r"`((?:diloco_core|diloco_sync|diloco_worker|diloco)\.[A-Za-z_][\w.]*)")


def sections() -> set[str]:
    return set(_HEADING.findall(PAGE.read_text(encoding="utf-8")))


def citations() -> list[tuple[str, str]]:
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in files:
        text = (ROOT / name).read_text(encoding="utf-8")
        for match in _CITATION.finditer(text):
            found += [(name, s) for s in re.findall(r"§(\d+(?:\.\d+)*)", match.group(1))]
    return found


def test_the_page_has_the_numbered_sections() -> None:
    assert {"1", "2", "2.4", "3", "3.11"} <= sections()


def test_every_cited_section_exists() -> None:
    cited = citations()
    assert len(cited) >= 14  # core, worker, runner, simulator and the docs cite it
    missing = [(name, s) for name, s in cited if s not in sections()]
    assert missing == []


def test_nothing_cites_a_page_outside_the_repository() -> None:
    files = subprocess.run(["git", "grep", "-l", "ALGORITHM" ".md"], cwd=ROOT, capture_output=True, text=True)
    assert files.stdout.split() == []


@pytest.mark.parametrize("dotted", sorted(set(_DOTTED.findall(PAGE.read_text(encoding="utf-8")))))
def test_every_named_module_and_function_exists(dotted: str) -> None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{dotted}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{dotted}: no such module")
