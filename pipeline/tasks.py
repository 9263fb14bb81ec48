"""What the built-in trainer optimises and measures: the task, chosen with `task=...` or `task._target_`.

A task turns a batch and the model's output into the training loss, and sums what validation
reports (the trainer reduces the sums over the ranks and divides by `count`).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
import torch.nn.functional as F


class Task:
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, float]:
        """Validation sums of one batch: `loss` (summed over samples) and `count`, plus the task's own."""
        raise NotImplementedError


class Classification(Task):
    """Cross-entropy over class logits; validation also reports accuracy."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, float]:
        return {"loss": F.cross_entropy(output, target, reduction="sum").item(),
                "accuracy": (output.argmax(1) == target).sum().item(), "count": float(len(target))}


TASKS: Dict[str, Any] = {"classification": Classification}


def build_task(cfg: Any) -> Task:
    from .registry import resolve

    builder, kwargs = resolve(cfg, TASKS, "task")
    return builder(**kwargs)


def reduce_sums(run: Any, totals: Dict[str, float], keys: Sequence[str]) -> Dict[str, float]:
    """Validation sums over every rank: `val_<key>` = sum / count."""
    t = torch.tensor([totals.get(k, 0.0) for k in keys] + [totals.get("count", 0.0)], dtype=torch.float64, device=run.device)
    t = run.comm.all_reduce_sum(t).cpu()
    count = float(t[-1]) or 1.0
    return {f"val_{k}": float(v) / count for k, v in zip(keys, t[:-1].tolist())}
