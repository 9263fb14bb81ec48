"""What a run's workers leave in its folder: metrics.jsonl, events (rank 0), per-rank logs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

import torch
from torch import nn

from .checkpoint.codec import Collectives
from .contract import events
from .contract.env import restart_count
from .contract.events import Event
from .contract.files import METRICS_FILE


class RunRecord:
    """Rank 0 writes the records; on other ranks every method is a no-op."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.enabled = run_dir, rank == 0
        self._metrics: Optional[TextIO] = None  # kept open: opening it for every row cost more than the row
        self._holding = False  # rows buffered until held() ends

    def event(self, kind: Event, **fields: Any) -> None:
        if self.enabled:
            events.append(self.run_dir, kind, restart=restart_count(), **fields)

    def metrics(self, **row: Any) -> None:
        if self.enabled:
            row = {"time": round(time.time(), 3), **row}
            if self._metrics is None:
                self._metrics = open(self.run_dir / METRICS_FILE, "a")
            self._metrics.write(json.dumps(row) + "\n")
            if not self._holding:
                self._metrics.flush()  # whole rows for a reader (the benchmarks, a person's tail -f)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Rows written inside reach the file together, at the end (one write for a message's windows)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if self._metrics is not None:
                self._metrics.flush()

    def close(self) -> None:
        """Close metrics.jsonl (a later row opens it again)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def model_sha256(model: nn.Module) -> str:
    """sha256 over every tensor of the state_dict, in key order, as contiguous CPU bytes. A sharded
    tensor (FSDP2's DTensor) is gathered whole first, a tensor at a time: collective, and the same
    digest as the unsharded model's."""
    from .checkpoint.shards import is_dtensor

    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
        t = whole.detach().cpu().contiguous().reshape(-1)
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


DETAILS = "steadfast.details"  # loggers under it write to the log files only, never to the console


class _FilesOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(DETAILS)


def setup_logging(run_dir: Path, rank: int) -> logging.Handler:
    """Every rank logs to logs/rank<r>.log; only rank 0 also logs to the console, without the details
    (DETAILS: the snapshot cadence's decisions), on any console handler (in the launcher's process
    too, with backend=local)."""
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
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if not any(isinstance(f, _FilesOnly) for f in handler.filters):
                handler.addFilter(_FilesOnly())
    root.setLevel(logging.INFO)
    return file_handler


class RunFolderNotShared(RuntimeError):
    """Some ranks do not see the run folder rank 0 writes to (no shared storage between the nodes)."""


def check_shared_run_dir(run_dir: Path, comm: "Collectives") -> None:
    """Collective, at start-up: every rank must see the run folder rank 0 writes checkpoints to.

    Rank 0 writes a token file with a random id into its run folder and broadcasts the id; every
    rank reads the file from its own run folder. Without shared storage (or with a different
    working directory on some node) a node sees another folder, and every rank fails here with a
    message naming the folders and hosts instead of resuming from nothing later.
    """
    if comm.world_size <= 1:
        return
    import socket
    import uuid

    host = socket.gethostname()
    token = run_dir / f".shared-check-{uuid.uuid4().hex}" if comm.rank == 0 else None
    if token is not None:
        token.write_text(token.name)
    name, root_dir, root_host = comm.broadcast_object((token.name if token else None, str(run_dir), host))
    try:
        sees = (run_dir / name).read_text() == name
    except OSError:
        sees = False
    seen = comm.gather_object((comm.rank, host, str(run_dir), sees))
    blind = [r for r in (seen or []) if not r[3]]
    message = ""
    if blind:
        who = "; ".join(f"rank {r} on {h} (its run folder: {d})" for r, h, d, _ in blind)
        message = (
            f"not every worker sees the run folder {root_dir} that rank 0 on {root_host} writes checkpoints to: {who} "
            f"cannot read the file rank 0 wrote there. The nodes of a multi-node job need shared storage mounted at "
            f"the same path, and the same working directory (or an absolute hydra.sweep.dir/run.name) on every node"
        )
    message = comm.broadcast_object(message)
    if token is not None:
        token.unlink(missing_ok=True)
    if message:
        raise RunFolderNotShared(message)
