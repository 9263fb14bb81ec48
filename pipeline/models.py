"""Built-in models and how a model is built from its config (by `name`, or by `_target_`).

A builder gets the data's `input_shape` (one sample's) and `output_size` (what the last layer
produces per sample, or per position for a sequence: the classes, the regression targets, the
vocabulary), plus the `model` node's own keys.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(
        self, input_shape: Sequence[int], output_size: int, hidden_sizes: Sequence[int] = (64, 64), dropout: float = 0.1
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, output_size))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 convolutions and a linear head, for small images shaped (channels, height, width)."""

    def __init__(
        self, input_shape: Sequence[int], output_size: int, channels: Sequence[int] = (16, 32), dropout: float = 0.1
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"model=cnn needs image data shaped (C, H, W); this data gives samples shaped {tuple(input_shape)}")
        layers: list[nn.Module] = []
        in_ch = input_shape[0]
        for ch in channels:
            layers += [nn.Conv2d(in_ch, ch, 3, padding=1), nn.ReLU()]
            in_ch = ch
        layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_ch * 4, output_size)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(), nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharTransformer(nn.Module):
    """A small decoder-only transformer over characters (nanoGPT's layout): token and position
    embeddings, `n_layer` pre-norm blocks of causal self-attention and an MLP, a linear head.

    `input_shape` is `(block_size,)`, the longest context; `output_size` is the vocabulary (the
    inputs are indices into the same vocabulary). Maps indices (B, T) to logits (B, T, vocabulary).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        output_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(
                f"model=transformer needs sequences of token indices; this data gives samples shaped {tuple(input_shape)}"
            )
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}")
        self.block_size = int(input_shape[0])
        self.tok_emb = nn.Embedding(output_size, n_embd)
        self.pos_emb = nn.Embedding(self.block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, output_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's block_size {self.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Continue each row of `idx` (B, T) by `new_tokens` sampled tokens (the last block_size as context)."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


MODELS: Dict[str, Callable[..., nn.Module]] = {"mlp": MLP, "cnn": CNN, "transformer": CharTransformer}


def build_model(cfg: Any, input_shape: Sequence[int], output_size: int) -> nn.Module:
    """`cfg` is the `model` node: its keys other than name/_target_ are the builder's arguments."""
    from .registry import resolve

    builder, kwargs = resolve(cfg, MODELS, "model")
    return builder(input_shape=tuple(input_shape), output_size=output_size, **kwargs)
