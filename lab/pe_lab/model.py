# Copyright 2026 The path-hf authors. Apache-2.0.
"""The lab's decoder: a small pre-norm transformer whose attention core is one of `positions.ENCODINGS`.

Everything but the encoding is fixed: RMSNorm, q/k/v/o projections without bias, a GELU MLP, tied embeddings. The
default shape (hidden 128, 4 layers, 4 heads of 32, MLP 512) has about 0.8M parameters plus the embeddings.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from .positions import ENCODINGS, NoPE, Shape


@dataclass(frozen=True)
class LabConfig:
    vocab_size: int
    encoding: str = "rope"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    train_length: int = 64
    max_length: int = 1024

    @property
    def shape(self) -> Shape:
        return Shape(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.hidden_size // self.num_heads,
            train_length=self.train_length,
            max_length=self.max_length,
        )


class LabAttention(nn.Module):
    """Project, attend through the encoding, project back."""

    def __init__(self, config: LabConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.hidden_size // config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.position: NoPE = ENCODINGS[config.encoding].build(config.shape)

    def heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = hidden.shape
        return tuple(
            proj(hidden).view(B, T, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )

    def forward(self, hidden: torch.Tensor, probabilities: list[torch.Tensor] | None = None) -> torch.Tensor:
        """With a list as `probabilities`, this layer's attention `[B, H, T, T]` is appended to it."""
        q, k, v = self.heads(hidden)
        if probabilities is None:
            return self.o_proj(self.position(q, k, v, hidden).flatten(2))
        out, layer_probabilities = self.position.attend(q, k, v, hidden)
        probabilities.append(layer_probabilities)
        return self.o_proj(out.flatten(2))


class LabBlock(nn.Module):
    def __init__(self, config: LabConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.self_attn = LabAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size, bias=False),
            nn.GELU(),
            nn.Linear(config.intermediate_size, config.hidden_size, bias=False),
        )

    def forward(self, hidden: torch.Tensor, probabilities: list[torch.Tensor] | None = None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), probabilities)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LabDecoder(nn.Module):
    """Token embeddings (+ an absolute position table where the encoding has one), the blocks, a tied head."""

    def __init__(self, config: LabConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        absolute = ENCODINGS[config.encoding].absolute
        self.embed_positions = absolute(config.shape) if absolute is not None else None
        self.layers = nn.ModuleList(LabBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # FLA's and Llama's init: every Linear and Embedding N(0, 0.02), biases 0 (PaTH's beta then starts at 1)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, probabilities: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits `[B, T, V]`; with a list as `probabilities`, every layer appends its attention `[B, H, T, T]`."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            hidden = self.embed_positions(hidden)
        for layer in self.layers:
            hidden = layer(hidden, probabilities)
        return self.norm(hidden) @ self.embed_tokens.weight.T

    def rescaled_rope(self, rescaling: str | None) -> ExitStack:
        """A context manager under which every RoPE layer uses a test-time `rescaling` beyond the training length."""
        stack = ExitStack()
        for layer in self.layers:
            stack.enter_context(layer.self_attn.position.rescaled(rescaling))
        return stack
