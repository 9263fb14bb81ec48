"""What happened in a run, from its records: launches, attempts, lost work, where the time went.

Pure: functions from already-read records (`records.RunRecords`, or the events and metric rows
alone) to the dataclasses of `model`. No files, no printing, no plotting; `loader` reads, `text`
and `plot` show.

The events of a launch carry the worker-side restart count (`restart`), which tells the attempts
of one launch apart (torch elastic's restarts and the launcher's relaunches alike). What each
part of the time breakdown holds: see `model`.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..config import FaultKind
from ..contract.events import LAUNCH_ENDS, Event
from ..contract.summary import Status
from .anomalies import handled
from .model import DISK, Attempt, Fault, Launch, Outcome, RunReport, SlowRank, TimeBreakdown, Unusable
from .records import MetricRow, RunRecords, Summary, integer, number, text

# Injected faults that end the attempt they fire in (hangs end through the watchdog's hang_detected).
FAILURE_FAULTS = frozenset(k.value for k in (FaultKind.kill, FaultKind.crash_in_save, FaultKind.exception, FaultKind.save_error))
_STARTS = (Event.ATTEMPT_STARTED, Event.RESUMED, Event.FIRST_STEP)
# The run's status when summary.json is missing: what the launcher would have written there (see summary.write).
_END_STATUS = {Event.JOB_COMPLETED: Status.COMPLETED, Event.JOB_FAILED: Status.FAILED, Event.JOB_INTERRUPTED: Status.PREEMPTED}
NO_END_RECORDED = "running, or its launcher was killed"


# ---- the timeline of launches and attempts ------------------------------------------------------
def _kind(e: Mapping[str, Any]) -> Optional[Event]:
    try:
        return Event(e.get("event"))
    except ValueError:
        return None


def _time(e: Mapping[str, Any]) -> float:
    return number(e.get("time")) or 0.0


def _saved(e: Mapping[str, Any]) -> str:
    return "(not saved)" if e.get("saved") is False else "(saved)"


def timeline(events: Iterable[Mapping[str, Any]], relative_to: Optional[str] = None) -> Tuple[List[Launch], List[Attempt]]:
    """The launches and attempts the events describe, each attempt with how it ended and the steps it reached.

    `relative_to`: a folder prefix cut from the source locations a hang names (the working directory)."""
    launches: List[Launch] = []
    attempts: List[Attempt] = []
    current: Dict[int, Attempt] = {}  # restart -> attempt, in the current launch
    records = sorted(
        ((k, e) for e in events if (k := _kind(e)) is not None and number(e.get("time")) is not None), key=lambda ke: _time(ke[1])
    )
    for kind, e in records:
        t = _time(e)
        if kind is Event.LAUNCH:
            launches.append(Launch(index=len(launches), start=t, end=t))
            current = {}
            continue
        if not launches:  # records before any launch record (an older folder): one implicit launch
            launches.append(Launch(index=0, start=t, end=t))
        launch = launches[-1]
        launch.end = max(launch.end, t)
        restart = integer(e.get("restart"))
        a = current.get(restart) if restart is not None else None
        if a is None and kind in _STARTS and restart is not None:
            a = _new_attempt(attempts, launch, restart, t)
            current[restart] = a
        newest = max(current.values(), key=lambda x: x.index) if current else None
        if kind in LAUNCH_ENDS:
            launch.ended_by, launch.stop_reason = kind, text(e.get("reason"), 60)
            _end_launch(list(current.values()), newest, kind, e, t)
        elif kind is Event.RELAUNCH and newest is not None and newest.outcome is Outcome.UNKNOWN:
            cause = text(e.get("cause"), 300)
            if cause:
                newest.ends(Outcome.FAILED, cause)
        elif kind is Event.PREEMPTION_GRACE_EXPIRED:
            for x in current.values():
                if x.outcome is Outcome.UNKNOWN:
                    x.ends(Outcome.PREEMPTED, f"preempted by {e.get('signal')}: not saved within the grace period")
        elif a is not None:
            _attempt_event(a, kind, e, t, relative_to)
    _close(launches, attempts)
    return launches, attempts


def _new_attempt(attempts: List[Attempt], launch: Launch, restart: int, t: float) -> Attempt:
    start = launch.start
    prev = attempts[-1] if attempts and attempts[-1].launch == launch.index else None
    if prev is not None:
        if prev.end is None:  # its end was not recorded: it had ended by now
            prev.end = t
        start = prev.end
    a = Attempt(index=len(attempts), launch=launch.index, restart=restart, start=start)
    attempts.append(a)
    return a


def _attempt_event(a: Attempt, kind: Event, e: Mapping[str, Any], t: float, relative_to: Optional[str]) -> None:
    step = integer(e.get("step"))
    if kind is Event.FAULT_FIRED:  # any rank records the step it had reached when its fault fired
        a.reached(step)
    if kind is Event.RESUMED:
        a.resumed_from = step or 0
        a.source = text(e.get("source"), 40) or DISK
    elif kind is Event.FIRST_STEP:
        a.first_step = a.first_step or t
    elif kind is Event.ATTEMPT_ENDED:
        a.end = t
        a.reached(integer(e.get("last_step")))
    elif kind is Event.CHECKPOINT_SAVED and step is not None:
        a.checkpoints.append((t, step))
        a.reached(step)
    elif kind is Event.TRAINING_COMPLETED:
        a.ends(Outcome.COMPLETED, "completed")
        a.reached(step)
        a.end = a.end or t
    elif kind is Event.PREEMPTED:
        a.ends(Outcome.PREEMPTED, f"preempted by {e.get('signal')} at step {step} {_saved(e)}")
        a.reached(step)
    elif kind is Event.MEMORY_LIMIT:
        a.ends(Outcome.STOPPED, f"memory limit at step {step} {_saved(e)}")
        a.reached(step)
    elif kind is Event.ANOMALY_STOP:
        a.ends(Outcome.STOPPED, f"anomalies: stopped at step {step} {_saved(e)}")
        a.reached(step)
    elif kind is Event.ATTEMPT_FAILED and text(e.get("cause"), 300):
        # the launcher's diagnosis of the first failure: over what any rank recorded before it
        a.ends(Outcome.FAILED, text(e.get("cause"), 300) or "")
        a.diagnosed = True
    elif a.outcome is not Outcome.UNKNOWN:
        return  # the first failure recorded is the cause; what follows is its consequence
    elif kind is Event.HANG_DETECTED:
        where = text(e.get("where"), 300) or "?"
        if relative_to:
            where = where.replace(relative_to.rstrip("/") + "/", "")
        a.ends(Outcome.FAILED, f"hang: rank {e.get('rank')} at step {step} ({where})")
        a.hung = (t - (number(e.get("seconds_without_progress")) or 0.0), t)
        a.end = a.end or t
    elif kind is Event.FAULT_FIRED and (e.get("fails") is True or e.get("fault") in FAILURE_FAULTS):
        a.ends(Outcome.FAILED, f"fault={e.get('fault')} on rank {e.get('rank')} at step {step}")
    elif kind is Event.WORKER_FAILED:
        a.ends(Outcome.FAILED, f"rank {e.get('rank')}: {text(e.get('error'), 300)}")


def _end_launch(current: List[Attempt], newest: Optional[Attempt], kind: Event, e: Mapping[str, Any], t: float) -> None:
    for a in current:
        a.end = a.end or t
    if newest is None or newest.outcome is not Outcome.UNKNOWN:
        return
    if kind is Event.JOB_INTERRUPTED:
        newest.ends(Outcome.PREEMPTED, f"stopped by {e.get('signal')}")
    elif kind is Event.JOB_STOPPED:
        newest.ends(Outcome.STOPPED, f"stopped: {text(e.get('message'), 300) or e.get('reason')}")
    elif kind is Event.JOB_COMPLETED:
        newest.ends(Outcome.COMPLETED, "completed")


def _close(launches: List[Launch], attempts: List[Attempt]) -> None:
    """Whatever ended an attempt without a cause of its own."""
    newest_of = {a.launch: a for a in attempts}
    for a in attempts:
        launch = launches[a.launch]
        if a.end is None:
            a.end = launch.end
        if a.outcome is not Outcome.UNKNOWN:
            continue
        if a is not newest_of[a.launch] or launch.ended_by is Event.JOB_FAILED:
            a.ends(Outcome.FAILED, "a worker died without recording an error (killed by a signal?)")
        elif launch.ended_by is None:
            a.cause = (
                NO_END_RECORDED if launch is launches[-1] else "the launch ended without a record (its launcher was killed?)"
            )


def lost_steps(attempts: Sequence[Attempt], metrics: Sequence[MetricRow]) -> None:
    """The steps each attempt lost: those it reached (its records, or its logged steps) beyond the
    step the next attempt resumed from."""
    for a in attempts:
        rows = attempt_rows(a, metrics)
        if rows:
            a.reached(max(r.step for r in rows))
    for a, nxt in zip(attempts, attempts[1:]):
        if a.last_step is not None and a.outcome is not Outcome.COMPLETED:
            a.lost_steps = max(0, a.last_step - nxt.resumed_from)


# ---- time -----------------------------------------------------------------------------------------
def attempt_rows(a: Attempt, metrics: Sequence[MetricRow]) -> List[MetricRow]:
    """The logged training steps of one attempt, in time order."""
    end = a.end if a.end is not None else float("inf")
    return sorted(
        (r for r in metrics if r.loss is not None and a.start <= r.time <= end and r.restart == a.restart), key=lambda r: r.time
    )


def step_times(attempts: Sequence[Attempt], metrics: Sequence[MetricRow]) -> None:
    """Seconds per step of each attempt: the median over consecutive logged steps (else the run's median)."""
    every: List[float] = []
    for a in attempts:
        mine = attempt_rows(a, metrics)
        gaps = [(b.time - x.time) / (b.step - x.step) for x, b in zip(mine, mine[1:]) if b.step > x.step]
        if gaps:
            a.step_time = statistics.median(gaps)
            every += gaps
    fallback = statistics.median(every) if every else None
    for a in attempts:
        if a.step_time is None:
            a.step_time = fallback


def breakdown(attempts: Sequence[Attempt], launches: Sequence[Launch], events: Iterable[Mapping[str, Any]]) -> TimeBreakdown:
    """Where the wall time of all launches went (step times must be known: `step_times`)."""
    wall = sum(launch.seconds for launch in launches)
    startup = sum(((a.first_step or a.end or a.start) - a.start) for a in attempts)
    checkpoint = 0.0
    snapshots = set()
    saves: List[Tuple[Any, Any, float]] = []
    for e in events:
        kind = _kind(e)
        if kind is Event.CHECKPOINT_SNAPSHOT:  # an asynchronous save: training waited for the snapshot only
            snapshots.add((e.get("pid"), e.get("step")))
            checkpoint += number(e.get("blocked_seconds")) or 0.0
        elif kind is Event.CHECKPOINT_SAVED:
            saves.append((e.get("pid"), e.get("step"), number(e.get("seconds")) or 0.0))
    checkpoint += sum(seconds for pid, step, seconds in saves if (pid, step) not in snapshots)
    useful = redone = 0.0
    for a, nxt in zip(attempts, [*attempts[1:], None]):
        reached = a.last_step if a.last_step is not None else a.resumed_from
        kept_to = min(reached, nxt.resumed_from) if nxt is not None else reached
        useful += max(0, kept_to - a.resumed_from) * (a.step_time or 0.0)
        redone += a.lost_steps * (a.step_time or 0.0)
    hung = sum(h1 - h0 for h0, h1 in (a.hung for a in attempts if a.hung))
    other = max(0.0, wall - startup - checkpoint - useful - redone - hung)
    return TimeBreakdown(wall=wall, useful=useful, redone=redone, checkpoint=checkpoint, startup=startup, hung=hung, other=other)


# ---- the whole run --------------------------------------------------------------------------------
def status(summary: Summary, launches: Sequence[Launch]) -> str:
    """The run's status: summary.json's, unless the newest launch has not recorded its end (then the
    summary, if any, is an earlier launch's); from the launch's end record when there is no summary."""
    if not launches:
        return summary.status or "no record"
    last = launches[-1]
    if last.ended_by is None:
        return NO_END_RECORDED
    if summary.status:
        return summary.status
    if last.ended_by is Event.JOB_STOPPED:
        return last.stop_reason if last.stop_reason in {s.value for s in Status} else Status.FAILED.value
    return _END_STATUS[last.ended_by].value


def analyse(records: RunRecords, relative_to: Optional[str] = None) -> RunReport:
    """The report of one run folder from its records (see `loader.load_run`)."""
    events = records.events
    launches, attempts = timeline(events, relative_to)
    lost_steps(attempts, records.metrics)
    step_times(attempts, records.metrics)
    invalid, faults, saved = [], [], 0
    for e in events:
        kind = _kind(e)
        if kind is Event.CHECKPOINT_SAVED:
            saved += 1
        elif kind is Event.CHECKPOINT_INVALID:
            invalid.append(Unusable(step=integer(e.get("step")), error=text(e.get("error"), 500) or "?"))
        elif kind is Event.FAULT_FIRED:
            faults.append(
                Fault(
                    fault=text(e.get("fault"), 60) or "?",
                    rank=integer(e.get("rank")),
                    step=integer(e.get("step")),
                    restart=integer(e.get("restart")),
                )
            )
    anomalies = handled(events)
    times = breakdown(attempts, launches, events)
    step_time = statistics.median([a.step_time for a in attempts if a.step_time] or [0.0])
    # the steps a rollback gave up were trained on top of those the attempt reached: time the rest held
    given_up = min(times.other, sum(h.redone for h in anomalies) * step_time)
    times.other, times.redone = times.other - given_up, times.redone + given_up
    return RunReport(
        folder=records.folder,
        status=status(records.summary, launches),
        summary=records.summary,
        metrics=records.metrics,
        launches=launches,
        attempts=attempts,
        breakdown=times,
        checkpoints_saved=saved,
        checkpoint_dir=records.checkpoint_dir,
        checkpoints_on_disk=records.checkpoints,
        invalid_on_resume=invalid,
        faults=faults,
        problems=list(records.problems),
        slow_ranks=slow_ranks(events),
        anomalies=anomalies,
    )


def slow_ranks(events: Iterable[Mapping[str, Any]]) -> List[SlowRank]:
    """The `straggler` records: ranks named slower than the others, and their recoveries, in time order."""
    return [
        SlowRank(
            rank=integer(e.get("rank")),
            host=text(e.get("host"), 100),
            step=integer(e.get("step")),
            ratio=number(e.get("ratio")),
            local_ms=number(e.get("local_ms")),
            median_ms=number(e.get("median_ms")),
            windows=integer(e.get("windows")),
            recovered=e.get("recovered") is True,
            restart=integer(e.get("restart")),
        )
        for e in sorted(events, key=_time)
        if _kind(e) is Event.STRAGGLER
    ]
