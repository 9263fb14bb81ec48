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

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Type,
    TypeVar,
)

from .files import EVENTS_FILE, PathLike, append_line, capped, read_jsonl
from .fits import field_types, fits


class Event(str, Enum):
    # -- the launcher (one per launch of a job, or per incarnation of its worker group) --
    LAUNCH = "launch"
    RELAUNCH = "relaunch"  # the launcher relaunches after a failure
    ATTEMPT_ENDED = "attempt_ended"
    ATTEMPT_FAILED = "attempt_failed"  # the first failure of an incarnation of the group, and its consequences
    HANG_DETECTED = "hang_detected"
    PREEMPTION_GRACE_EXPIRED = "preemption_grace_expired"
    JOB_COMPLETED = "job_completed"
    JOB_FAILED = "job_failed"
    JOB_INTERRUPTED = "job_interrupted"
    JOB_STOPPED = "job_stopped"  # a stop that must not be restarted
    SLURM_SUBMITTED = "slurm_submitted"
    # -- the workers (rank 0 unless said otherwise) --
    RENDEZVOUS = "rendezvous"
    ATTEMPT_STARTED = "attempt_started"
    RESUMED = "resumed"
    FIRST_STEP = "first_step"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SNAPSHOT = "checkpoint_snapshot"  # an asynchronous save's blocking part
    CHECKPOINT_INVALID = "checkpoint_invalid"  # skipped on resume
    CHECKPOINT_SET_ASIDE = "checkpoint_set_aside"  # an unusable checkpoint kept aside
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # checkpoint.every_n_seconds=auto chose an interval
    CONFIG_CHANGED_ON_RESUME = "config_changed_on_resume"
    WORLD_SIZE_CHANGED = "world_size_changed"
    SNAPSHOT_INTERVAL = "snapshot_interval"  # memory snapshots start in an attempt, or their interval changes
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"  # memory snapshots off for this job
    FAULT_FIRED = "fault_fired"  # any rank
    STRAGGLER = "straggler"  # the slow rank itself: named, and once when it recovers
    ANOMALY = "anomaly"  # a non-finite value, a loss spike, replicas that diverged: what every rank did about it
    WORKER_FAILED = "worker_failed"  # any rank
    PREEMPTED = "preempted"
    MEMORY_LIMIT = "memory_limit"
    ANOMALY_STOP = "anomaly_stop"  # stopped: more rollbacks than anomaly.max_rollbacks allows (or no healthy state)
    TRAINING_COMPLETED = "training_completed"  # what summary.json reports

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Record:
    """What every event has; a kind's record type adds its own fields (all optional: a field a
    writer leaves out is None)."""

    KIND: ClassVar[Event]
    OPEN: ClassVar[bool] = False  # True: takes fields beyond its own (an app's notes), kept in `extra`
    time: float = 0.0
    host: str = ""
    pid: int = 0
    restart: Optional[int] = None  # the worker's restart count (the workers' records carry it)
    extra: Dict[str, Any] = field(default_factory=dict, compare=False)

    def fields(self) -> Dict[str, Any]:
        """The kind's fields that are set, then `extra` (not the header: the writer sets it)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _HEADER}
        return {**{k: v for k, v in own.items() if v is not None}, **self.extra}


_HEADER = ("time", "host", "pid", "extra")
RECORDS: Dict[Event, Type[Record]] = {}
R = TypeVar("R", bound=Type[Record])


def _kind(kind: Event) -> Callable[[R], R]:
    def register(cls: R) -> R:
        cls.KIND = kind
        RECORDS[kind] = cls
        return cls

    return register


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


@_kind(Event.RENDEZVOUS)
@dataclass(frozen=True)
class Rendezvous(Record):
    world_size: Optional[int] = None
    endpoint: Optional[str] = None  # address:port
    run_id: Optional[str] = None


@_kind(Event.ATTEMPT_STARTED)
@dataclass(frozen=True)
class AttemptStarted(Record):
    world_size: Optional[int] = None
    device: Optional[str] = None


@_kind(Event.RESUMED)
@dataclass(frozen=True)
class Resumed(Record):
    step: Optional[int] = None
    path: Optional[str] = None
    epoch: Optional[int] = None
    batch_in_epoch: Optional[int] = None
    sample_in_epoch: Optional[int] = None
    saved_world_size: Optional[int] = None
    world_size: Optional[int] = None
    source: Optional[str] = None  # disk or memory


@_kind(Event.FIRST_STEP)
@dataclass(frozen=True)
class FirstStep(Record):
    step: Optional[int] = None
    seconds_since_launch: Optional[float] = None


@_kind(Event.CHECKPOINT_SAVED)
@dataclass(frozen=True)
class CheckpointSaved(Record):
    step: Optional[int] = None
    epoch: Optional[int] = None
    path: Optional[str] = None
    bytes: Optional[int] = None
    seconds: Optional[float] = None


@_kind(Event.CHECKPOINT_SNAPSHOT)
@dataclass(frozen=True)
class CheckpointSnapshot(Record):
    step: Optional[int] = None
    blocked_seconds: Optional[float] = None


@_kind(Event.CHECKPOINT_INVALID)
@dataclass(frozen=True)
class CheckpointInvalid(Record):
    step: Optional[int] = None
    path: Optional[str] = None
    error: Optional[str] = None


@_kind(Event.CHECKPOINT_SET_ASIDE)
@dataclass(frozen=True)
class CheckpointSetAside(Record):
    step: Optional[int] = None
    path: Optional[str] = None
    moved_to: Optional[str] = None
    error: Optional[str] = None


@_kind(Event.CHECKPOINT_INTERVAL)
@dataclass(frozen=True)
class CheckpointInterval(Record):
    seconds: Optional[float] = None
    save_seconds: Optional[float] = None
    mtbf_seconds: Optional[float] = None
    failures: Optional[int] = None
    how: Optional[str] = None


@_kind(Event.CONFIG_CHANGED_ON_RESUME)
@dataclass(frozen=True)
class ConfigChangedOnResume(Record):
    step: Optional[int] = None
    accepted: Optional[str] = None
    changes: Optional[List[Any]] = None


@_kind(Event.WORLD_SIZE_CHANGED)
@dataclass(frozen=True)
class WorldSizeChanged(Record):
    OPEN: ClassVar[bool] = True  # the app's notes on what it does about it (policy, lr_scale, ...)
    step: Optional[int] = None
    saved_world_size: Optional[int] = None
    world_size: Optional[int] = None
    epoch: Optional[int] = None
    sample_in_epoch: Optional[int] = None
    batch_per_worker: Optional[int] = None
    global_batch: Optional[int] = None


@_kind(Event.SNAPSHOT_INTERVAL)
@dataclass(frozen=True)
class SnapshotInterval(Record):
    """The interval in force from `step` on, until the attempt ends or the next of these: written at
    an attempt's first snapshot (no `previous_every_n_steps`) and whenever `auto` changes it."""

    step: Optional[int] = None
    every_n_steps: Optional[int] = None
    previous_every_n_steps: Optional[int] = None
    auto: Optional[bool] = None
    bytes: Optional[int] = None  # one node's copy (of the two it holds)
    segment: Optional[str] = None
    seconds: Optional[float] = None  # a copy's time (at a change: the least of the recent ones, on the slowest rank)
    step_seconds: Optional[float] = None  # at a change: a step's time without the copy (the least recent, fastest rank)


@_kind(Event.SNAPSHOT_UNAVAILABLE)
@dataclass(frozen=True)
class SnapshotUnavailable(Record):
    reason: Optional[str] = None


@_kind(Event.FAULT_FIRED)
@dataclass(frozen=True)
class FaultFired(Record):
    fault: Optional[str] = None
    rank: Optional[int] = None
    step: Optional[int] = None
    fails: Optional[bool] = None  # the attempt fails (hangs: see hang_detected)
    path: Optional[str] = None  # the checkpoint a fault damaged
    tensor: Optional[str] = None  # bitflip: the parameter whose bit it flipped


@_kind(Event.STRAGGLER)
@dataclass(frozen=True)
class Straggler(Record):
    """A rank whose local work per step (loading the batch, the forward) exceeded the other ranks' median
    by logger.straggler_margin for `windows` logging windows in a row (steadfast/telemetry/_stragglers.py); written
    by that rank (`host`, `pid`: its own)."""

    rank: Optional[int] = None
    ratio: Optional[float] = None  # local_ms / median_ms
    local_ms: Optional[float] = None  # its mean local time per step in the deciding window
    median_ms: Optional[float] = None  # the other ranks' median
    windows: Optional[int] = None
    step: Optional[int] = None  # the last step of the deciding window
    recovered: Optional[bool] = None  # False: named; True: no longer slower


@_kind(Event.ANOMALY)
@dataclass(frozen=True)
class Anomaly(Record):
    """What every rank agreed it saw (steadfast/health/), at the same step (`agreed_at`), and what they
    did: went back to `restored_step` skipping `skipped`, or healed the replicas; written by rank 0."""

    anomaly: Optional[str] = None  # nonfinite_loss, loss_spike, nonfinite_grad_norm, divergence
    step: Optional[int] = None  # the first step that showed it (a divergence: the fingerprints' step)
    ranks: Optional[List[int]] = None  # the ranks that showed it, the first to first (a divergence: that differ)
    value: Optional[float] = None  # the loss or gradient norm seen, when finite
    agreed_at: Optional[int] = None
    action: Optional[str] = None  # rolled_back, or healed (from `source_rank`: a majority's)
    restored_step: Optional[int] = None
    source: Optional[str] = None  # memory or disk; healed: the rank whose parameters were copied
    skipped: Optional[List[int]] = None  # [epoch, first sample, samples, first batch, batches] of that epoch's order
    samples: Optional[List[int]] = None  # the dataset indices skipped (the run's loader; the first 64)
    hosts: Optional[List[str]] = None  # a divergence: the hosts of the ranks that differ
    tensor: Optional[str] = None  # a divergence: the first parameter that differs
    suspect: Optional[List[int]] = None  # ranks found diverged twice or more: suspect hardware


@_kind(Event.WORKER_FAILED)
@dataclass(frozen=True)
class WorkerFailed(Record):
    rank: Optional[int] = None
    error: Optional[str] = None  # 'TypeError: ...': the exception's type, then its message
    where: Optional[str] = None  # file:line in function, where it was raised
    step: Optional[int] = None  # the step it had reached (its heartbeat's)
    recurs: Optional[str] = None  # the code that raised it knew it comes back on every attempt: why (contract.failures)


@dataclass(frozen=True)
class TaskStopped(Record):
    """A task that stopped on purpose after it saved (its kind is the summary's status)."""

    step: Optional[int] = None
    epoch: Optional[int] = None
    batch_in_epoch: Optional[int] = None
    saved: Optional[bool] = None
    message: Optional[str] = None
    checkpoint: Optional[str] = None
    result: Optional[Dict[str, Any]] = None


@_kind(Event.PREEMPTED)
@dataclass(frozen=True)
class Preempted(TaskStopped):
    signal: Optional[str] = None
    signal_number: Optional[int] = None
    signal_to_commit_s: Optional[float] = None


@_kind(Event.MEMORY_LIMIT)
@dataclass(frozen=True)
class MemoryLimit(TaskStopped):
    rank: Optional[int] = None
    rss_mb: Optional[float] = None


@_kind(Event.ANOMALY_STOP)
@dataclass(frozen=True)
class AnomalyStop(TaskStopped):
    """anomaly.max_rollbacks passed (its `anomaly` events are the evidence), or no healthy state to go back to."""


@_kind(Event.TRAINING_COMPLETED)
@dataclass(frozen=True)
class TrainingCompleted(Record):
    step: Optional[int] = None
    model_sha256: Optional[str] = None
    result: Optional[Dict[str, Any]] = None


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
