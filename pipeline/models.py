"""Built-in models and how a model is built from its config (by `name`, or by `_target_`)."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Sequence

from torch import nn


class MLP(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden_sizes: Sequence[int] = (64, 64), dropout: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 convolutions and a linear head, for small images shaped (channels, height, width)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (16, 32), dropout: float = 0.1) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"model=cnn needs image data shaped (C, H, W); this data gives samples shaped {tuple(input_shape)}")
        layers: list[nn.Module] = []
        in_ch = input_shape[0]
        for ch in channels:
            layers += [nn.Conv2d(in_ch, ch, 3, padding=1), nn.ReLU()]
            in_ch = ch
        layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_ch * 4, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.net(x)


MODELS: Dict[str, Callable[..., nn.Module]] = {"mlp": MLP, "cnn": CNN}


def build_model(cfg: Any, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """`cfg` is the `model` node: its keys other than name/_target_ are the builder's arguments."""
    from .registry import resolve

    builder, kwargs = resolve(cfg, MODELS, "model")
    return builder(input_shape=tuple(input_shape), num_classes=num_classes, **kwargs)
