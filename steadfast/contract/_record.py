"""The base of the event vocabulary (steadfast/contract/events.py): the kinds, what every record
has, and the registry a record type joins with `kind`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar, Dict, Optional, Type, TypeVar


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
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save the store could not take (unreachable): training goes on
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


def kind_of(kind: Event) -> Callable[[R], R]:
    def register(cls: R) -> R:
        cls.KIND = kind
        RECORDS[kind] = cls
        return cls

    return register
