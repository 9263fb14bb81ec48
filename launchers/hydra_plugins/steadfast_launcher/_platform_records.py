"""Library mode's records: a launch that lasts across the platform's restarts, its failures named from
the workers' own records, its end and summary.json written by a worker.

Under a platform (docs/platforms.md) no process of ours outlives the workers. So:

- a launch is open from its `launch` event (with `platform` set) until an event that ends it
  (`job_completed`, `job_interrupted`, ...). Rank 0 of every incarnation of the platform's workers
  continues the open launch of its platform, or opens one; a launch the platform gave up on stays
  open, and the next start of the same command continues it;
- the incarnation before a continued one ended in a failure: rank 0 names its first failure from
  what its workers recorded (`worker_failed`, their heartbeats), with the launcher's own rule
  (`_diagnosis.diagnose`), and records it as `attempt_failed`: summary.json lists it under `failures`;
- rank 0 records the end of a launch that completed or stopped (the launcher's `_record_end`);
- a worker that fails writes summary.json as failed, naming the first failure the records show so
  far: the platform may restart the workers, and the next end rewrites it.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hydra.core.utils import filter_overrides

from steadfast.contract import events, pids, summary
from steadfast.contract.events import Event
from steadfast.contract.files import HEARTBEAT_DIR
from steadfast.contract.heartbeat import read_heartbeat, read_heartbeats
from steadfast.contract.platforms import Detected
from steadfast.contract.summary import Status

from ._diagnosis import RankEnd, diagnose, first_line


@dataclass(frozen=True)
class Opened:
    launch_id: str  # what every rank agrees on (the snapshot folder's name): from the launch event
    since: float  # the launch event's time: the summary covers what happened since
    incarnations: int  # how many incarnations of the platform's workers ran in this launch before this one


PREVIOUS = "previous"  # heartbeats/previous/rank<r>: the heartbeat of the worker before this one
_MARKS = (Event.LAUNCH, *events.LAUNCH_ENDS)  # where launches open and end


def _launch_id(record: events.Record) -> str:
    return f"{record.host}-{record.pid}-{record.time!r}"


def open_launch(run_dir: Path, found: Detected, backend: str, overrides: Sequence[str]) -> Opened:
    """Rank 0, before the group forms: continue its platform's open launch, naming the previous
    incarnation's failure, or open a new one."""
    marks = events.records(run_dir, kinds=_MARKS)
    newest = marks[-1] if marks else None
    if isinstance(newest, events.Launch) and newest.platform == found.name:
        started = events.records(run_dir, since=newest.time, kinds=(Event.ATTEMPT_STARTED,))
        if started:
            _name_failure(run_dir, started[-1])
        return Opened(_launch_id(newest), newest.time, len(started))
    before = time.time() - 1.0
    events.write(run_dir, events.Launch(backend=backend, overrides=list(filter_overrides(overrides)), platform=found.name))
    mine = [
        r
        for r in events.records(run_dir, since=before, kinds=(Event.LAUNCH,))
        if r.pid == os.getpid() and r.host == socket.gethostname()
    ]
    record = mine[-1] if mine else events.Launch(time=round(time.time(), 3), host=socket.gethostname(), pid=os.getpid())
    return Opened(_launch_id(record), record.time, 0)


def restarts_since(run_dir: Path, since: float) -> int:
    """Incarnations of the platform's workers in the launch since `since`, less the first."""
    return max(0, len(events.records(run_dir, since=since, kinds=(Event.ATTEMPT_STARTED,))) - 1)


def _ends_of(run_dir: Path, since: float, world_size: int, complete: bool) -> List[RankEnd]:
    """How each rank of the incarnation that started at `since` ended, from what it recorded. `complete`:
    the incarnation is over, so a rank without a record ended without one (killed by a signal)."""
    ends = {}
    for record in events.records(run_dir, since=since, kinds=(Event.WORKER_FAILED,)):
        if isinstance(record, events.WorkerFailed) and record.rank is not None and record.rank not in ends:
            ends[record.rank] = RankEnd(
                rank=record.rank,
                pid=record.pid,
                host=record.host,
                error=record.error,
                where=record.where,
                error_at=record.time,
                ended_at=record.time,
            )
    if complete:
        beats, earlier = read_heartbeats(run_dir), _previous_heartbeats(run_dir)
        here = socket.gethostname()
        for rank in range(world_size):
            if rank in ends:
                continue
            beat = beats.get(rank) or {}
            if beat.get("host") == here and pids.alive(int(beat.get("pid") or 0)):  # a new worker's already
                beat = earlier.get(rank) or {}
            step = beat.get("step")
            ends[rank] = RankEnd(
                rank=rank,
                pid=int(beat.get("pid") or 0),
                host=str(beat.get("host") or "?"),
                step=step if isinstance(step, int) else -1,
            )
    return [ends[r] for r in sorted(ends)]


def keep_previous_heartbeat(run_dir: Path, rank: int) -> None:
    """Before this rank's heartbeat starts: its predecessor's, moved aside for rank 0's account of
    how that one ended (a restarted pod may start before rank 0 looks)."""
    folder = run_dir / HEARTBEAT_DIR
    try:
        (folder / PREVIOUS).mkdir(parents=True, exist_ok=True)
        os.replace(folder / f"rank{rank}", folder / PREVIOUS / f"rank{rank}")
    except OSError:
        pass


def _previous_heartbeats(run_dir: Path) -> Dict[int, Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for path in (run_dir / HEARTBEAT_DIR / PREVIOUS).glob("rank*"):
        record = read_heartbeat(path)  # validated: a record torn or damaged is skipped
        if record is not None:
            out[record["rank"]] = record
    return out


def _name_failure(run_dir: Path, started: events.Record) -> None:
    world_size = getattr(started, "world_size", None) or 1
    found = diagnose(_ends_of(run_dir, started.time, world_size, complete=True))
    if found is None:
        return
    c = found.cause
    events.write(
        run_dir,
        events.AttemptFailed(
            rank=c.rank,
            worker_pid=c.pid or None,
            step=c.step if c.step >= 0 else None,
            how=c.how(),
            error=first_line(c.error, 500) if c.error else None,
            where=c.where,
            cause=found.line(),
            consequences=[e.record() for e in found.consequences],
        ),
    )


def record_failure(run_dir: Path, platform: str, since: float, started: float) -> None:
    """A worker that failed: summary.json says failed, with the first failure its records show so far
    (since `started`, this incarnation's start). Never raises."""
    try:
        found = diagnose(_ends_of(run_dir, started, 0, complete=False))
        error = found.line() if found is not None else "a worker failed"
        summary.write(
            run_dir,
            Status.FAILED,
            since=since,
            restarts=restarts_since(run_dir, since),
            wall_seconds=time.time() - since,
            error=f"{error} (under {platform}, which may restart the workers: the next end rewrites this file)",
        )
    except Exception:  # recording must never hide the original error
        pass
