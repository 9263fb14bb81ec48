"""The record types of the events the workers write (the launcher's are in events.py, which names
them all: import them from there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional

from ._record import Event, Record
from ._record import kind_of as _kind


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


@_kind(Event.CHECKPOINT_FAILED)
@dataclass(frozen=True)
class CheckpointFailed(Record):
    step: Optional[int] = None
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
