"""What the report says about a run: its launches, attempts, time breakdown (the analysis's output).

An attempt is one incarnation of the worker group: from its launch (or the end of the attempt
before it) to its end, with where it resumed from (a checkpoint on disk, or a snapshot in
memory) and the steps it lost: those it reached beyond where the next attempt resumed.

The time breakdown of a run (all launches of the same run folder together):
  useful       steps that are part of the final model, at the measured time per step
  redone       steps trained and then lost to a failure (trained again after the resume), or given
               up by a rollback (an anomaly: trained again or skipped)
  checkpoint   time training waited for checkpoints (the whole save when synchronous, the
               snapshot when asynchronous)
  startup      from a launch or a failure to the first step of the next attempt: process start,
               rendezvous, restore (restarts included)
  hung         from a hung rank's last progress to the watchdog's detection
  other        the rest: validation, shutdown, waiting
goodput = useful / wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import List, Optional, Tuple

from ..contract.events import Event
from .anomalies import Handled
from .records import CheckpointCheck, MetricRow, Summary

# Where an attempt resumed from: the `source` of its `resumed` event (absent in older records: disk).
DISK, MEMORY = "disk", "memory"


class Outcome(str, Enum):
    COMPLETED = "completed"
    PREEMPTED = "preempted"  # stopped on request (saved, or not within the grace period)
    FAILED = "failed"
    STOPPED = "stopped"  # stopped on purpose, not to be restarted (memory limit, a refused resume)
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass
class Launch:
    """One launch of the run folder: from its `launch` record to its last record."""

    index: int
    start: float
    end: float
    ended_by: Optional[Event] = None  # the launcher's record of its end; None: none (running, or killed)
    stop_reason: Optional[str] = None  # a job_stopped record's reason (a summary status, e.g. memory_limit)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Attempt:
    """One incarnation of the worker group within a launch."""

    index: int
    launch: int
    restart: int
    start: float
    first_step: Optional[float] = None
    end: Optional[float] = None
    resumed_from: int = 0
    source: Optional[str] = None  # where it resumed from (DISK, MEMORY); None: it started from scratch
    last_step: Optional[int] = None
    outcome: Outcome = Outcome.UNKNOWN
    cause: str = ""
    diagnosed: bool = False  # the cause is the launcher's diagnosis (attempt_failed), not a rank's own record
    lost_steps: int = 0  # steps it reached beyond where the next attempt resumed
    step_time: Optional[float] = None  # seconds per step
    checkpoints: List[Tuple[float, int]] = field(default_factory=list)  # (time, step)
    hung: Optional[Tuple[float, float]] = None  # (last progress, detection) when the watchdog found it stuck

    def reached(self, step: Optional[int]) -> None:
        if step is not None:
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def ends(self, outcome: Outcome, cause: str) -> None:
        self.outcome, self.cause = outcome, cause

    @property
    def how_it_ended(self) -> str:
        return self.cause or self.outcome.value


@dataclass
class TimeBreakdown:
    """Seconds of the run's wall time (all launches) by what they were spent on; see the module doc."""

    wall: float = 0.0
    useful: float = 0.0
    redone: float = 0.0
    checkpoint: float = 0.0
    startup: float = 0.0
    hung: float = 0.0
    other: float = 0.0

    @staticmethod
    def parts() -> Tuple[str, ...]:
        return tuple(f.name for f in fields(TimeBreakdown) if f.name != "wall")

    def part(self, name: str) -> float:
        return float(getattr(self, name))

    @property
    def goodput(self) -> Optional[float]:
        return self.useful / self.wall if self.wall > 0 else None


@dataclass(frozen=True)
class Fault:
    fault: str
    rank: Optional[int]
    step: Optional[int]
    restart: Optional[int]


@dataclass(frozen=True)
class SlowRank:
    """A rank named a straggler, or no longer slower (a `straggler` record; see steadfast/telemetry/_stragglers.py)."""

    rank: Optional[int]
    host: Optional[str]
    step: Optional[int]
    ratio: Optional[float]  # its local work per step over the other ranks' median
    local_ms: Optional[float]
    median_ms: Optional[float]
    windows: Optional[int]
    recovered: bool
    restart: Optional[int]


@dataclass(frozen=True)
class Unusable:
    """A checkpoint the resume found unusable and skipped (a `checkpoint_invalid` record)."""

    step: Optional[int]
    error: str


@dataclass
class RunReport:
    folder: Path
    status: str
    summary: Summary
    metrics: List[MetricRow]
    launches: List[Launch]
    attempts: List[Attempt]
    breakdown: TimeBreakdown
    checkpoints_saved: int
    checkpoint_dir: Optional[str]
    checkpoints_on_disk: List[CheckpointCheck]
    invalid_on_resume: List[Unusable]
    faults: List[Fault]
    problems: List[str]
    slow_ranks: List[SlowRank] = field(default_factory=list)
    anomalies: List[Handled] = field(default_factory=list)  # what the anomaly guard found and did

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - len(self.launches))

    @property
    def preemptions(self) -> int:
        return sum(1 for a in self.attempts if a.outcome is Outcome.PREEMPTED)

    @property
    def wall(self) -> float:
        return self.breakdown.wall

    @property
    def goodput(self) -> Optional[float]:
        return self.breakdown.goodput

    @property
    def resumed_from_memory(self) -> bool:
        return any(a.source == MEMORY for a in self.attempts)
