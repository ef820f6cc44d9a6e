"""The built-in model: a small GPT-style decoder, in the nanoGPT style, over bytes (vocabulary 256) or the
token ids of your data (``ModelSettings.vocab_size``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diloco_core.config import ModelSettings
from torch import Tensor, nn
from torch.nn import functional as F

VOCAB_SIZE = 256
EMBEDDING_NAMES = ("wte.weight", "wpe.weight")


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 128
    vocab_size: int = VOCAB_SIZE
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> GPTConfig:
        if settings.n_embd % settings.n_head != 0:
            raise ValueError(f"n_embd ({settings.n_embd}) must be a multiple of n_head ({settings.n_head})")
        return cls(
            block_size=settings.block_size,
            vocab_size=settings.vocab_size,
            n_layer=settings.n_layer,
            n_head=settings.n_head,
            n_embd=settings.n_embd,
            dropout=settings.dropout,
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        out: Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Decoder-only transformer; the output projection is tied to the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # scaled init of the residual projections (GPT-2)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, time, vocab) for token (byte) ids of shape (batch, time)."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds the context length {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits


def build_gpt(settings: ModelSettings) -> GPT:
    """The built-in model, seeded from ``settings.seed`` so every learner starts identically."""
    config = GPTConfig.from_settings(settings)
    devices: list[int] = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(settings.seed)
        return GPT(config)


def flops_per_token(model: nn.Module) -> float:
    """Training FLOPs (forward and backward) per token: 6 per parameter that takes part in a matrix
    product, plus, for the built-in GPT, attention's 12 x layers x width x context (PaLM, appendix B;
    nanoGPT estimates MFU the same way). Position embeddings are looked up, not multiplied, and a
    tied parameter counts once."""
    n = sum(p.numel() for name, p in model.named_parameters() if name != "wpe.weight")
    if not isinstance(model, GPT):
        return 6.0 * n
    c = model.config
    return 6.0 * n + 12.0 * c.n_layer * c.n_embd * c.block_size


def lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Next-token (next-byte) cross-entropy."""
    x, y = batch
    logits = model(x)
    loss: Tensor = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    return loss
