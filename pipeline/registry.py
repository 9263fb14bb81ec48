"""Choosing a builder by `name` (built-ins) or by `_target_` (your own code, by import path)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Tuple, cast

from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf


def resolve(cfg: Any, builtins: Dict[str, Callable[..., Any]], group: str) -> Tuple[Callable[..., Any], Dict[str, Any]]:
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        node = dataclasses.asdict(cfg)
    elif isinstance(cfg, DictConfig):
        node = cast(Dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    else:
        node = dict(cfg)
    target = node.pop("_target_", None)
    name = node.pop("name", None)
    if target:
        return get_method(target), node
    if name not in builtins:
        raise ValueError(f"{group}.name={name!r} is not allowed: one of {', '.join(builtins)}, or set {group}._target_")
    return builtins[name], node
