"""The run's event log, `events.jsonl`: one vocabulary, one writer (`append`), one reader (`read`).

The launcher, the workers, the report and the benchmarks all use these; no event kind is written
as a string literal anywhere else. Every record has `time`, `event`, `host` and `pid`, plus the
kind's own fields (listed beside each kind).
"""

from __future__ import annotations

import json
import os
import socket
import time
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from .files import EVENTS_FILE, PathLike, read_jsonl


class Event(str, Enum):
    # -- the launcher (one per launch of a job, or per incarnation of its worker group) --
    LAUNCH = "launch"  # backend, overrides
    RELAUNCH = "relaunch"  # attempt, cause: the launcher relaunches after a failure
    ATTEMPT_ENDED = "attempt_ended"  # restart, last_step, steps {rank: step}, phases
    HANG_DETECTED = "hang_detected"  # rank, step, phase, seconds_without_progress, where, suspects, waiting, stacks
    PREEMPTION_GRACE_EXPIRED = "preemption_grace_expired"  # signal, grace_s, ranks
    JOB_COMPLETED = "job_completed"  # relaunches
    JOB_FAILED = "job_failed"  # restarts, error
    JOB_INTERRUPTED = "job_interrupted"  # attempt, signal
    JOB_STOPPED = "job_stopped"  # reason, step, message (a stop that must not be restarted)
    SLURM_SUBMITTED = "slurm_submitted"  # slurm_job_id, script, nodes
    # -- the workers (rank 0 unless said otherwise) --
    RENDEZVOUS = "rendezvous"  # world_size, endpoint, run_id
    ATTEMPT_STARTED = "attempt_started"  # world_size, device
    RESUMED = "resumed"  # step, path, epoch, batch_in_epoch, sample_in_epoch, saved_world_size, world_size, source
    FIRST_STEP = "first_step"  # step, seconds_since_launch
    CHECKPOINT_SAVED = "checkpoint_saved"  # step, epoch, path, bytes, seconds
    CHECKPOINT_SNAPSHOT = "checkpoint_snapshot"  # step, blocked_seconds (an asynchronous save's blocking part)
    CHECKPOINT_INVALID = "checkpoint_invalid"  # step, path, error: skipped on resume
    CHECKPOINT_SET_ASIDE = "checkpoint_set_aside"  # step, path, moved_to, error: an unusable checkpoint kept aside
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # seconds, save_seconds, mtbf_seconds, how: checkpoint.every_n_seconds=auto
    CONFIG_CHANGED_ON_RESUME = "config_changed_on_resume"  # step, accepted, changes
    WORLD_SIZE_CHANGED = "world_size_changed"  # step, saved_world_size, world_size, policy, ...
    SNAPSHOT_CREATED = "snapshot_created"  # bytes, every_n_steps, segment (the launcher, for a job with memory snapshots)
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"  # reason: memory snapshots off for this job
    FAULT_FIRED = "fault_fired"  # fault, rank, step (any rank)
    WORKER_FAILED = "worker_failed"  # rank, error, where (any rank)
    PREEMPTED = "preempted"  # step, epoch, saved, signal, signal_to_commit_s
    MEMORY_LIMIT = "memory_limit"  # step, saved, rank, rss_mb
    TRAINING_COMPLETED = "training_completed"  # step, model_sha256, result {...}: what summary.json reports

    def __str__(self) -> str:
        return self.value


# The stop events a task writes when it stopped on purpose (their kind is the summary's status).
STOP_EVENTS = (Event.PREEMPTED, Event.MEMORY_LIMIT)
LAUNCH_ENDS = (Event.JOB_COMPLETED, Event.JOB_FAILED, Event.JOB_INTERRUPTED, Event.JOB_STOPPED)


def append(folder: PathLike, kind: Event, **fields: Any) -> None:
    """Append one event to the run's events file.

    One `write` of one line on a file opened with O_APPEND, so lines written by the launcher
    and by the workers at the same time never interleave.
    """
    record = {
        "time": round(time.time(), 3),
        "event": Event(kind).value,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **fields,
    }
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(Path(folder) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(folder: PathLike, since: Optional[float] = None, kinds: Optional[Iterable[Event]] = None) -> List[Dict[str, Any]]:
    """The run's events in file order (records without a known kind or a numeric time are skipped),
    optionally only those at or after `since` and of the given kinds."""
    wanted = {Event(k).value for k in kinds} if kinds is not None else None
    known = {e.value for e in Event}
    out = []
    for record in read_jsonl(Path(folder) / EVENTS_FILE):
        kind, t = record.get("event"), record.get("time")
        if kind not in known or isinstance(t, bool) or not isinstance(t, (int, float)):
            continue
        if since is not None and t < since:
            continue
        if wanted is not None and kind not in wanted:
            continue
        out.append(record)
    return out


def first(records: Iterable[Dict[str, Any]], kind: Event, **match: Any) -> Optional[Dict[str, Any]]:
    for record in records:
        if record.get("event") == Event(kind).value and all(record.get(k) == v for k, v in match.items()):
            return record
    return None


def last(records: Iterable[Dict[str, Any]], kind: Event, **match: Any) -> Optional[Dict[str, Any]]:
    return first(reversed(list(records)), kind, **match)
