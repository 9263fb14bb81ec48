"""The run's event log, `events.jsonl`: its vocabulary, one writer and one reader.

Each kind of event (`Event`) has its record type here: a small frozen dataclass that declares the
kind's fields and their types, on top of what every record has (`time`, `host`, `pid`, and the
workers' `restart`). The writer checks every event against its kind's record type before it writes
it (an unknown field or a value of the wrong type is a TypeError), so a new field is added in one
place, its record type. The launcher writes typed records (`write`); the workers name a kind and
its fields (`append(folder, Event.X, **fields)`, what `RunRecord.event` calls). `read` returns the
records as JSON objects (what the report's own validating loader takes); `records` returns them typed.
No event kind is written as a string literal anywhere else.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Any,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Type,
    TypeVar,
)

from ._record import RECORDS as RECORDS
from ._record import Event as Event
from ._record import Record as Record
from ._record import kind_of as _kind

# the workers' record types, re-exported: events.X names every record type
from ._worker_events import Anomaly as Anomaly
from ._worker_events import AnomalyStop as AnomalyStop
from ._worker_events import AttemptStarted as AttemptStarted
from ._worker_events import CheckpointFailed as CheckpointFailed
from ._worker_events import CheckpointInterval as CheckpointInterval
from ._worker_events import CheckpointInvalid as CheckpointInvalid
from ._worker_events import CheckpointSaved as CheckpointSaved
from ._worker_events import CheckpointSetAside as CheckpointSetAside
from ._worker_events import CheckpointSnapshot as CheckpointSnapshot
from ._worker_events import ConfigChangedOnResume as ConfigChangedOnResume
from ._worker_events import FaultFired as FaultFired
from ._worker_events import FirstStep as FirstStep
from ._worker_events import MemoryLimit as MemoryLimit
from ._worker_events import Preempted as Preempted
from ._worker_events import Rendezvous as Rendezvous
from ._worker_events import Resumed as Resumed
from ._worker_events import SnapshotInterval as SnapshotInterval
from ._worker_events import SnapshotUnavailable as SnapshotUnavailable
from ._worker_events import Straggler as Straggler
from ._worker_events import TaskStopped as TaskStopped
from ._worker_events import TrainingCompleted as TrainingCompleted
from ._worker_events import WorkerFailed as WorkerFailed
from ._worker_events import WorldSizeChanged as WorldSizeChanged
from .files import EVENTS_FILE, PathLike, append_line, capped, read_jsonl
from .fits import field_types, fits


@_kind(Event.LAUNCH)
@dataclass(frozen=True)
class Launch(Record):
    backend: Optional[str] = None
    overrides: Optional[List[str]] = None
    platform: Optional[str] = None  # library mode: the platform that started the workers (contract/platforms.py)


@_kind(Event.RELAUNCH)
@dataclass(frozen=True)
class Relaunch(Record):
    attempt: Optional[int] = None
    cause: Optional[str] = None


@_kind(Event.ATTEMPT_ENDED)
@dataclass(frozen=True)
class AttemptEnded(Record):
    last_step: Optional[int] = None
    steps: Optional[Dict[str, int]] = None  # {rank: the last step it reached}
    phases: Optional[Dict[str, str]] = None


@_kind(Event.ATTEMPT_FAILED)
@dataclass(frozen=True)
class AttemptFailed(Record):
    """The launcher's diagnosis of one failed incarnation: the rank whose failure came first (from exit
    statuses, signals, the workers' own records and the watchdog) and the ranks that failed because of it."""

    rank: Optional[int] = None
    worker_pid: Optional[int] = None
    step: Optional[int] = None
    how: Optional[str] = None  # 'killed by SIGKILL', 'raised ValueError: ...', 'hung (...)', 'exited with code 3'
    signal: Optional[str] = None
    exit_code: Optional[int] = None
    error: Optional[str] = None
    where: Optional[str] = None
    cause: Optional[str] = None  # the one line the console, train.log, the report and summary.json show
    consequences: Optional[List[Dict[str, Any]]] = None  # {rank, host, pid, how, step, signal|exit_code, error}
    raised: Optional[List[Dict[str, Any]]] = None  # each rank's own error: {rank, step, error} (the next attempt's is compared)
    not_restarted: Optional[str] = None  # why the job stops here: the failure would come back on every attempt


@_kind(Event.HANG_DETECTED)
@dataclass(frozen=True)
class HangDetected(Record):
    rank: Optional[int] = None
    step: Optional[int] = None
    phase: Optional[str] = None
    seconds_without_progress: Optional[float] = None
    hang_timeout_s: Optional[float] = None
    where: Optional[str] = None
    suspects: Optional[List[int]] = None
    waiting: Optional[List[int]] = None
    stacks: Optional[List[str]] = None


@_kind(Event.PREEMPTION_GRACE_EXPIRED)
@dataclass(frozen=True)
class PreemptionGraceExpired(Record):
    signal: Optional[str] = None
    grace_s: Optional[float] = None
    ranks: Optional[Dict[str, Any]] = None  # {rank: {step, phase}}


@_kind(Event.JOB_COMPLETED)
@dataclass(frozen=True)
class JobCompleted(Record):
    relaunches: Optional[int] = None


@_kind(Event.JOB_FAILED)
@dataclass(frozen=True)
class JobFailed(Record):
    restarts: Optional[int] = None
    error: Optional[str] = None


@_kind(Event.JOB_INTERRUPTED)
@dataclass(frozen=True)
class JobInterrupted(Record):
    attempt: Optional[int] = None
    signal: Optional[str] = None


@_kind(Event.JOB_STOPPED)
@dataclass(frozen=True)
class JobStopped(Record):
    reason: Optional[str] = None
    step: Optional[int] = None
    message: Optional[str] = None


@_kind(Event.SLURM_SUBMITTED)
@dataclass(frozen=True)
class SlurmSubmitted(Record):
    slurm_job_id: Optional[str] = None
    script: Optional[str] = None
    nodes: Optional[int] = None


assert set(RECORDS) == set(Event), "every kind of event needs its record type"
# The stop events a task writes when it stopped on purpose (their kind is the summary's status).
STOP_EVENTS = (Event.PREEMPTED, Event.MEMORY_LIMIT, Event.ANOMALY_STOP)
LAUNCH_ENDS = (Event.JOB_COMPLETED, Event.JOB_FAILED, Event.JOB_INTERRUPTED, Event.JOB_STOPPED)


def _hints(cls: Type[Record]) -> Dict[str, Any]:
    return {k: v for k, v in field_types(cls).items() if k != "extra"}


def check(kind: Event, fields: Mapping[str, Any]) -> None:
    """TypeError naming what does not fit `kind`'s record type: a field it does not have, or a value of the wrong type."""
    cls = RECORDS[Event(kind)]
    hints = _hints(cls)
    unknown = sorted(k for k in fields if k not in hints)
    if unknown and not cls.OPEN:
        raise TypeError(f"event {Event(kind).value}: no field(s) {', '.join(unknown)} (its fields: {', '.join(hints)})")
    wrong = [f"{k}={v!r} (expected {hints[k]})" for k, v in fields.items() if k in hints and not fits(hints[k], v)]
    if wrong:
        raise TypeError(f"event {Event(kind).value}: {'; '.join(wrong)}")


def append(folder: PathLike, kind: Event, **fields: Any) -> None:
    """Append one event to the run's events file, after checking it against its kind's record type.

    One `write` of one line on a file opened with O_APPEND, so lines written by the launcher
    and by the workers at the same time never interleave.
    """
    check(kind, fields)
    record = {
        "time": round(time.time(), 3),
        "event": Event(kind).value,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **fields,
    }
    append_line(Path(folder) / EVENTS_FILE, (json.dumps(capped(record), default=str) + "\n").encode())


def write(folder: PathLike, record: Record) -> None:
    """Append a typed record (its time, host and pid are the writer's, unless it set host or pid)."""
    header = {k: getattr(record, k) for k in ("host", "pid") if getattr(record, k)}
    append(folder, record.KIND, **header, **record.fields())


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


def typed(raw: Mapping[str, Any]) -> Record:
    """One event read back as its record type: a field whose value is not of its type reads as None;
    fields the type does not declare are kept in `extra`."""
    cls = RECORDS[Event(raw["event"])]
    hints = {**_hints(cls), "time": float, "host": str, "pid": int}
    own = {k: v for k, v in raw.items() if k in hints and fits(hints[k], v)}
    extra = {k: v for k, v in raw.items() if k not in hints and k != "event"}
    return cls(**own, extra=extra)


def records(folder: PathLike, since: Optional[float] = None, kinds: Optional[Iterable[Event]] = None) -> List[Record]:
    """`read`, typed."""
    return [typed(r) for r in read(folder, since=since, kinds=kinds)]


T = TypeVar("T", bound=Record)


def newest(found: Iterable[Record], cls: Type[T]) -> Optional[T]:
    """The last record of type `cls` among `found`."""
    return next((r for r in reversed(list(found)) if isinstance(r, cls)), None)
