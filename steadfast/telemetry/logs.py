"""Per-rank logs: every rank logs to logs/rank<r>.log in the run folder; rank 0 also to the console."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..contract.failures import printable

DETAILS = "steadfast.details"  # loggers under it write to the log files only, never to the console


class _FilesOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(DETAILS)


class _PrintableFormatter(logging.Formatter):
    """A worker's log lines show only printable characters (control characters as \\xNN): nothing it
    logs (an exception's message, a file name) can rewrite the terminal or the log a person reads."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def setup_logging(run_dir: Path, rank: int) -> logging.Handler:
    """Every rank logs to logs/rank<r>.log; only rank 0 also logs to the console, without the details
    (DETAILS: the snapshot cadence's decisions), on any console handler (in the launcher's process
    too, with backend=local)."""
    (run_dir / "logs").mkdir(exist_ok=True)
    root = logging.getLogger()
    fmt = _PrintableFormatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if rank == 0 and not any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers
    ):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        root.addHandler(console)
    for handler in root.handlers:
        # a console: a plain StreamHandler (ours, Hydra's); not a file, nor a subclass that captures
        # records for a program (pytest's caplog handler lives for a whole session)
        if type(handler) is logging.StreamHandler:
            if not any(isinstance(f, _FilesOnly) for f in handler.filters):
                handler.addFilter(_FilesOnly())
    root.setLevel(logging.INFO)
    return file_handler
