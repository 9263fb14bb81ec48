"""What the built-in trainer optimises and measures: the task, chosen with `task=...` or `task._target_`.

A task turns a batch and the model's output into the training loss, and sums what validation
reports (the trainer reduces the sums over the ranks and divides by `count`): `val_loss` for every
task, plus the task's own metrics (`val_<key>` for each key of its sums besides loss and count;
pipeline/config.py's task schemas declare them, so the launcher's pre-flight can check
`trainer.objective` without importing torch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from steadfast import Run


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
        return {
            "loss": F.cross_entropy(output, target, reduction="sum").item(),
            "accuracy": (output.argmax(1) == target).sum().item(),
            "count": float(len(target)),
        }


class Regression(Task):
    """Mean squared error over real-valued targets (every target of every sample weighs the same);
    validation also reports the mean absolute error."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target.view_as(output))

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, float]:
        diff = output - target.view_as(output)
        return {"loss": diff.pow(2).sum().item(), "mae": diff.abs().sum().item(), "count": float(diff.numel())}


class LanguageModel(Task):
    """Next-token cross-entropy: logits (batch, time, vocabulary) against the next indices (batch,
    time), every position weighing the same; validation also reports bits per character."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, float]:
        nats = F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="sum").item()
        return {"loss": nats, "bits_per_char": nats / math.log(2), "count": float(target.numel())}


TASKS: Dict[str, Any] = {"classification": Classification, "regression": Regression, "language_model": LanguageModel}


def build_task(cfg: Any) -> Task:
    from .registry import resolve

    builder, kwargs = resolve(cfg, TASKS, "task")
    return builder(**kwargs)


def reduce_sums(run: Run, totals: Dict[str, float], keys: Sequence[str]) -> Dict[str, float]:
    """Validation sums over every rank: `val_<key>` = sum / count."""
    t = torch.tensor([totals.get(k, 0.0) for k in keys] + [totals.get("count", 0.0)], dtype=torch.float64, device=run.device)
    t = run.comm.all_reduce_sum(t).cpu()
    count = float(t[-1]) or 1.0
    return {f"val_{k}": float(v) / count for k, v in zip(keys, t[:-1].tolist())}
