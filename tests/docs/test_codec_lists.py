"""The quantizer and payload-kind lists that README.md and docs/internals.md give are the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from diloco_core.codec import PayloadKind
from diloco_core.config import Quantizer
from diloco_core.quantize import QUANTIZERS

ROOT = Path(__file__).resolve().parents[2]


def _line(page: str, starts: str) -> str:
    lines = [ln for ln in (ROOT / page).read_text(encoding="utf-8").splitlines() if ln.startswith(starts)]
    assert len(lines) == 1, f"{page}: one line starting {starts!r}, found {len(lines)}"
    return lines[0]


def test_one_list_of_quantizers() -> None:
    assert get_args(Quantizer) == QUANTIZERS


def test_internals_lists_every_quantizer_and_payload_kind() -> None:
    names = re.findall(r'"(\w+)"', _line("docs/internals.md", "- Quantizer names"))
    assert tuple(names) == QUANTIZERS
    kinds = re.findall(r'`"(\w+)"`', "\n".join(
        ln for ln in (ROOT / "docs/internals.md").read_text(encoding="utf-8").split("- Payload kinds", 1)[1]
        .split("\n- ", 1)[0].splitlines()
    ))  # fmt: skip
    assert tuple(kinds) == get_args(PayloadKind)


def test_the_readme_names_every_quantizer() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    sentence = text[text.index("quantizes it") : text.index("compresses it with zstd")]
    spelled = {"top-k": "topk"}
    found = {
        spelled.get(w, w)
        for w in re.findall(r"\b(fp32|bf16|fp16|int8|int4|e3m0|int2|int1|top-k)\b", sentence)
    }
    assert found == set(QUANTIZERS)
