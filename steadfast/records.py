"""What a run's workers leave in its folder: metrics.jsonl, events (rank 0), per-rank logs."""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from .contract import events
from .contract.env import restart_count
from .contract.events import Event
from .contract.files import METRICS_FILE


class RunRecord:
    """Rank 0 writes the records; on other ranks every method is a no-op."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.enabled = run_dir, rank == 0

    def event(self, kind: Event, **fields: Any) -> None:
        if self.enabled:
            events.append(self.run_dir, kind, restart=restart_count(), **fields)

    def metrics(self, **row: Any) -> None:
        if self.enabled:
            row = {"time": round(time.time(), 3), **row}
            with open(self.run_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")


def model_sha256(model: nn.Module) -> str:
    """sha256 over every tensor of the state_dict, in key order, as contiguous CPU bytes."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def setup_logging(run_dir: Path, rank: int) -> logging.Handler:
    """Every rank logs to logs/rank<r>.log; only rank 0 also logs to the console."""
    (run_dir / "logs").mkdir(exist_ok=True)
    root = logging.getLogger()
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if rank == 0 and not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        root.addHandler(console)
    root.setLevel(logging.INFO)
    return file_handler
