"""Per-rank logs: every rank logs to logs/rank<r>.log in the run folder; rank 0 also to the console."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(run_dir: Path, rank: int) -> logging.Handler:
    """Every rank logs to logs/rank<r>.log; only rank 0 also logs to the console."""
    (run_dir / "logs").mkdir(exist_ok=True)
    root = logging.getLogger()
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if rank == 0 and not any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers
    ):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        root.addHandler(console)
    root.setLevel(logging.INFO)
    return file_handler
