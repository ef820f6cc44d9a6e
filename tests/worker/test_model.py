from __future__ import annotations

import pytest
import torch
from diloco_core.config import ModelSettings
from diloco_worker.model import EMBEDDING_NAMES, VOCAB_SIZE, GPTConfig, build_gpt, lm_loss

from tests.worker.helpers import TINY


def test_forward_gives_logits_over_bytes() -> None:
    model = build_gpt(TINY)
    x = torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, VOCAB_SIZE)


def test_same_seed_same_weights_different_seed_different() -> None:
    a, b = build_gpt(TINY), build_gpt(TINY)
    c = build_gpt(TINY.model_copy(update={"seed": 1}))
    for (name, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))


def test_building_does_not_disturb_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_gpt(TINY)
    assert torch.equal(torch.rand(3), expected)


def test_output_projection_is_tied_and_embeddings_are_named() -> None:
    model = build_gpt(TINY)
    names = {n for n, _ in model.named_parameters()}
    assert set(EMBEDDING_NAMES) <= names
    assert "lm_head.weight" not in names  # tied: listed once, as the token embedding
    assert model.lm_head.weight is model.wte.weight


def test_too_long_sequence_is_refused() -> None:
    model = build_gpt(TINY)
    with pytest.raises(ValueError, match="exceeds the context length 32"):
        model(torch.zeros((1, 33), dtype=torch.long))


def test_heads_must_divide_width() -> None:
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig.from_settings(ModelSettings(n_embd=30, n_head=4))


def test_initial_loss_is_near_uniform_and_a_few_steps_reduce_it() -> None:
    torch.manual_seed(0)
    model = build_gpt(TINY)
    x = torch.randint(0, 256, (4, 33))
    batch = (x[:, :-1], x[:, 1:])
    first = lm_loss(model, batch).item()
    assert abs(first - torch.log(torch.tensor(256.0)).item()) < 0.3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(10):
        loss = lm_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert lm_loss(model, batch).item() < first - 0.5
