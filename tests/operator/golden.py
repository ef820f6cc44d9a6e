"""Golden YAML files: compare, or rewrite them all with DILOCO_REGEN_GOLDEN=1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

GOLDEN_DIR = Path(__file__).parent / "golden"


def check_golden(name: str, data: Any) -> None:
    path = GOLDEN_DIR / f"{name}.yaml"
    text = yaml.safe_dump_all(data if isinstance(data, list) else [data], sort_keys=True, width=120)
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; run with DILOCO_REGEN_GOLDEN=1 to write it"
    expected = list(yaml.safe_load_all(path.read_text()))
    actual = list(yaml.safe_load_all(text))
    assert actual == expected, f"{path} differs; review and regenerate with DILOCO_REGEN_GOLDEN=1"
