"""Checks of the settings that a single field's range cannot express."""

from __future__ import annotations

import pytest
from diloco_core.config import DataSettings, DiLoCoSettings, ModelSettings
from pydantic import ValidationError


def test_the_builtin_model_needs_an_embedding_its_heads_can_split() -> None:
    with pytest.raises(ValidationError, match=r"n_embd \(128\) must be a multiple of n_head \(3\)"):
        ModelSettings(n_head=3, n_embd=128)
    assert ModelSettings(n_head=8, n_embd=128).n_head == 8
    # a user model reads these settings as it likes
    assert ModelSettings(entry_point="user_model:build", n_head=3, n_embd=128).n_head == 3


@pytest.mark.parametrize("entry", ["builtin", "user_model:build", "pkg.sub_2.mod:make_task", "_x:_y"])
def test_entry_points_that_can_be_resolved(entry: str) -> None:
    assert ModelSettings(entry_point=entry).entry_point == entry


@pytest.mark.parametrize(
    "entry",
    [
        "",
        "user_model",
        "user_model.build",
        "my model:build",
        "a:b:c",
        "1mod:f",
        "pkg.:f",
        "mod:f()",
        "Builtin",
    ],
)
def test_entry_points_that_cannot(entry: str) -> None:
    with pytest.raises(ValidationError, match="entry_point"):
        ModelSettings(entry_point=entry)


def test_overlap_stays_below_the_inner_steps() -> None:
    with pytest.raises(ValidationError, match="overlap"):
        DiLoCoSettings(inner_steps=4, overlap=4)


def test_a_tokenizer_is_only_for_a_text_corpus() -> None:
    with pytest.raises(ValidationError, match="a tokenizer applies to a text corpus; format 'tokens'"):
        DataSettings(format="tokens", tokenizer="tokenizer.json")
    assert DataSettings(tokenizer="tokenizer.json").format == "text"
