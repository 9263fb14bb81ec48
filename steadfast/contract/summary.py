"""`summary.json`, the run's outcome in one small file. This module is its only writer.

The launcher writes it once at the end of every launch, from what the launch recorded in
`events.jsonl`: a task that finished says so with a `training_completed` event carrying its
result (epochs, steps, losses, `model_sha256`, ...); a task that stopped on purpose writes a stop
event (`preempted`, `memory_limit`); a failure is the launcher's own knowledge. So the summary
is derived from the event log, and the launchers of a multi-node job agree on it: only the
launcher that hosted global rank 0 writes a completed run's summary.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional

from . import events
from .events import Event
from .files import SUMMARY_FILE, PathLike, atomic_write, read_json_object


class Status(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"  # stopped on request; the same command continues
    MEMORY_LIMIT = "memory_limit"  # stopped by trainer.max_rss_mb after a checkpoint

    def __str__(self) -> str:
        return self.value


# the fields of a stop event that the summary reports
_STOP_FIELDS = {"step": "stop_step", "saved": "stop_saved", "signal": "stop_signal", "message": "error"}


def read(run_dir: Optional[PathLike]) -> Dict[str, Any]:
    """The run's summary, or {} when there is none (or it is unusable)."""
    if run_dir is None:
        return {}
    return read_json_object(Path(run_dir) / SUMMARY_FILE) or {}


def write(
    run_dir: PathLike,
    status: Status,
    *,
    since: float,
    restarts: int,
    wall_seconds: float,
    error: Optional[str] = None,
    hosts_rank0: bool = True,
    **extra: Any,
) -> Dict[str, Any]:
    """Write the summary of the launch that started at `since`; returns what the file now says.

    The task's own record of this launch's outcome (`training_completed`, or the stop event named
    like the status) gives the fields: its `result` object, and for a stop where it stopped.
    A launcher that did not host global rank 0 (a multi-node job) leaves a completed run's summary
    to rank 0's launcher, and never turns a run rank 0 completed into a failure. `extra` fields
    fill in what the task did not record.
    """
    run_dir = Path(run_dir)
    status = Status(status)
    recorded = events.read(run_dir, since=since, kinds=(Event.TRAINING_COMPLETED, *events.STOP_EVENTS))
    if not hosts_rank0 and (status == Status.COMPLETED or events.last(recorded, Event.TRAINING_COMPLETED) is not None):
        return read(run_dir)
    own = {
        Status.COMPLETED: Event.TRAINING_COMPLETED,
        Status.PREEMPTED: Event.PREEMPTED,
        Status.MEMORY_LIMIT: Event.MEMORY_LIMIT,
    }.get(status)
    record = events.last(recorded, own) if own is not None else None
    summary: Dict[str, Any] = {}
    if record is not None and isinstance(record.get("result"), dict):
        summary.update(record["result"])
    if status in (Status.PREEMPTED, Status.MEMORY_LIMIT):
        summary.update(stop_step=None, stop_saved=False)
        if record is not None:
            summary.update({name: record.get(key) for key, name in _STOP_FIELDS.items() if key in record})
    summary.update({k: v for k, v in extra.items() if v is not None and summary.get(k) is None})
    summary["status"] = status.value
    summary.setdefault("restarts", restarts)
    summary.setdefault("wall_seconds", round(wall_seconds, 3))
    if error:
        summary["error"] = error
    atomic_write(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    return summary
