"""`summary.json`, the run's outcome in one small file. This module is its only writer.

The launcher writes it once at the end of every launch, from what the launch recorded in
`events.jsonl`: a task that finished says so with a `training_completed` event carrying its
result (epochs, steps, losses, `model_sha256`, ...); a task that stopped on purpose writes a stop
event (`preempted`, `memory_limit`, `anomaly_stop`); a failure is the launcher's own knowledge. So the summary
is derived from the event log, and the launchers of a multi-node job agree on it: only the
launcher that hosted global rank 0 writes a completed run's summary.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional, Type

from . import events
from .events import Event
from .files import SUMMARY_FILE, PathLike, atomic_write, read_json_object


class Status(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"  # stopped on request; the same command continues
    MEMORY_LIMIT = "memory_limit"  # stopped by trainer.max_rss_mb after a checkpoint
    ANOMALY_STOP = "anomaly_stop"  # stopped by anomaly.max_rollbacks after committing the healthy state it went back to

    def __str__(self) -> str:
        return self.value


# What a task's own stop record (preempted, memory_limit) tells the summary, by summary key.
_STOP_FIELDS = {"stop_step": "step", "stop_saved": "saved", "stop_signal": "signal", "error": "message"}
# The task's own record of a launch that ended with this status.
_OWN_RECORD: Dict[Status, Type[events.Record]] = {
    Status.COMPLETED: events.TrainingCompleted,
    Status.PREEMPTED: events.Preempted,
    Status.MEMORY_LIMIT: events.MemoryLimit,
    Status.ANOMALY_STOP: events.AnomalyStop,
}


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
    to rank 0's launcher, and never turns a run rank 0 completed into a failure. A failed launch
    never replaces a completed run's summary (its `model_sha256`, its result): the failure is in
    the events, and the file is left as it is. `extra` fields fill in what the task did not record.
    """
    run_dir = Path(run_dir)
    status = Status(status)
    if status is Status.FAILED and read(run_dir).get("status") == Status.COMPLETED.value:
        return read(run_dir)
    recorded = events.records(run_dir, since=since, kinds=(Event.TRAINING_COMPLETED, *events.STOP_EVENTS))
    if not hosts_rank0 and (status is Status.COMPLETED or events.newest(recorded, events.TrainingCompleted) is not None):
        return read(run_dir)
    own = _OWN_RECORD.get(status)
    record = events.newest(recorded, own) if own is not None else None
    summary: Dict[str, Any] = {}
    result = getattr(record, "result", None)
    if isinstance(result, dict):
        summary.update(result)
    if isinstance(record, events.TaskStopped):
        summary.update(stop_step=None, stop_saved=False)
        given = record.fields()
        summary.update({name: given[key] for name, key in _STOP_FIELDS.items() if key in given})
    elif status in (Status.PREEMPTED, Status.MEMORY_LIMIT, Status.ANOMALY_STOP):
        summary.update(stop_step=None, stop_saved=False)
    summary.update({k: v for k, v in extra.items() if v is not None and summary.get(k) is None})
    summary["status"] = status.value
    summary.setdefault("restarts", restarts)
    summary.setdefault("wall_seconds", round(wall_seconds, 3))
    # each failed incarnation of this launch, by its first failure (the launcher's diagnosis), oldest first
    failures = [
        r.cause
        for r in events.records(run_dir, since=since, kinds=(Event.ATTEMPT_FAILED,))
        if isinstance(r, events.AttemptFailed) and r.cause
    ]
    if failures:
        summary["failures"] = failures
    if error:
        summary["error"] = error
    atomic_write(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    return summary
