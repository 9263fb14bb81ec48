"""When the memory tier copies (snapshot.every_n_steps), and what it records and says about it.

The copies themselves, their slots and their reading back are steadfast/checkpoint/memory.py's.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from ..checkpoint.memory import MemorySnapshots, announce_off, fits
from ..contract.events import Event
from ..distributed.exchange import Exchange

log = logging.getLogger("steadfast.details.snapshots")  # the rank logs only (telemetry.logs.DETAILS)

COPIES = {2: "two", 3: "three", 4: "four"}
MEMORY_SHARE = 0.02  # snapshot.every_n_steps=auto: a copy per interval costs at most this share of its steps' time
SMOOTHING = 8  # auto: the least of this many recent measurements (copies, windows of steps) decides
LOWER_AT = 1 / 4  # auto lowers the interval only when a quarter of it would keep to the budget


class MemoryCadence:
    """When a run takes its snapshots (snapshot.every_n_steps), and what it tells a person about them.

    A snapshot is due once `every` steps have passed since the last one (or since the step the
    attempt started from): counted from the last snapshot, not from step 0, so that a new interval
    never stretches a gap. A process death at step k therefore loses at most the interval in force
    at step k - 1 (no snapshot came after the last one, so each step in between had fewer than
    `every` steps behind it); a death in the middle of a copy leaves the other buffer, the snapshot
    before, which that bound already counts from.

    auto: every step until the steps between two exchanges are timed, then the smallest power of two at which
    a copy costs at most MEMORY_SHARE of a step's time (the step without the copy), from the least
    of the recent copy times (the slowest rank's) and of the recent step times (the fastest rank's),
    agreed by every rank at the same steps: other processes and a validation only ever add to a
    time, so the least is what the work itself takes (on a loaded machine a median of copies moved
    3x); the ranks' numbers ride the control plane's periodic message (steadfast/distributed/exchange.py): sent at
    one exchange, decided on at the next. Raised as soon as the budget is exceeded, lowered only when a quarter of the interval would
    do (LOWER_AT), it stays put while the measurements jitter, and every change is a factor of two
    or more: each is recorded (snapshot_interval, as is the attempt's first snapshot) and logged on
    rank 0, so the records always say the interval in force. The first snapshot checks, on every
    node, that its copies (two; four with the anomaly guard, else two) fit in the shared-memory filesystem; if one node has no room, all of them
    go without.

    It is given what it uses: the snapshots, the ranks' exchange (and through it their collectives),
    an event sink, the tracked state (objects and per-rank, name -> Stateful), the snapshot fault's hook and a clock."""

    def __init__(
        self,
        memory: MemorySnapshots,
        every: Union[int, str],
        exchange: Exchange,
        record: Callable[..., None],
        tracked: Tuple[Dict[str, Any], Dict[str, Any]],
        during_snapshot: Callable[[int], None],
        clock: Callable[[], float] = time.perf_counter,
        protect: Callable[[], Sequence[int]] = tuple,
    ) -> None:
        self.memory, self.record, self.tracked, self.during_snapshot = memory, record, tracked, during_snapshot
        self.protect = protect  # the steps whose newest snapshot at or before a copy keeps (MemorySnapshots.take)
        self.before_copy: Callable[[], None] = _nothing  # right before a snapshot is taken (the heartbeat's file written)
        self.exchange, self.comm, self.clock = exchange, exchange.comm, clock
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)  # the interval in force
        self._first = True
        self._last: Optional[int] = None  # the newest snapshot's step, or the step the attempt started from
        self._costs: Deque[float] = deque(maxlen=SMOOTHING)  # this rank's recent copy times
        self._steps: Deque[float] = deque(maxlen=SMOOTHING)  # this rank's recent step times, without the copy
        self._work, self._work_steps = 0.0, 0  # time in steps (copies excluded) since the last retune, and how many
        self._mark: Optional[Tuple[int, float]] = None  # (step, clock) up to which steps are in _work: the last copy's end
        self.off = False  # snapshots are off on every rank from now on
        self._decided = False  # auto: the first interval agreed (until then a copy every step, an exchange every step)
        exchange.ride(self.retune)
        exchange.hold(lambda: self.auto and not self.off and not self._decided)

    def next_due(self, step: int) -> int:
        """The first step after `step` whose `at_step` may copy (at the interval now in force)."""
        return step + 1 if self._last is None else max(step + 1, self._last + self.every)

    def at_step(self, step: int) -> bool:
        """Take this step's snapshot if it is due; False when snapshots are off from now on (on every rank).
        Called at every step, or only at the steps `next_due` names: the steps between need nothing."""
        if self._last is None:  # the first step of this attempt: the one before is restored (or step 0)
            self._last = step - 1
            self._mark = step, self.clock()
        if step - self._last < self.every:
            return True
        started = self._measure(step)
        memory = self.memory
        planned = memory.plan(*self.tracked)
        announce = self._first
        if self._first:  # every rank takes the same decision: a node without room turns them off everywhere
            self._first = False
            size, copies = sum(layout.size for _, layout in planned), memory.copies
            problems = [fits(memory.segments, size, n) if memory.writes_objects else None for n in (copies, 2)]
            short = self.comm.max_each([1.0 if problem else 0.0 for problem in problems])
            if short[1]:
                announce_off(self.record, problems[1] or "another node's shared memory is too small for them")
                self.off = True
                return False
            if short[0]:  # room for two on every node: snapshots as ever, none kept for the anomaly guard's rollbacks
                memory.keep(2)
                log.info("Snapshots in memory: two copies, not %d (%s); a rollback goes back to disk", copies, problems[0])
        self.before_copy()
        try:
            memory.take(step, planned, lambda: self.during_snapshot(step), self.protect())
        except OSError as exc:
            announce_off(self.record, f"writing to {memory.folder.parent} failed ({exc.strerror or exc})")
            raise  # the ranks must stop snapshotting together: a failure here is a failure of the step
        ended = self.clock()
        self._last, self._mark = step, (step, ended)
        memory.seconds = ended - started
        self._costs.append(memory.seconds)
        if announce and self.comm.rank == 0:
            log.info(
                "Snapshots in memory: %.1f MB per node (%s copies in %s), %s from step %d",
                memory.bytes / 1e6,
                COPIES.get(memory.copies, memory.copies),
                memory.folder.parent,
                _every(self.every, self.auto),
                step,
            )
            self._record(step, memory.seconds)
        return True

    def rewound(self, step: int) -> None:
        """A rollback restored step `step`: the next snapshot is due counting from it."""
        self._last, self._mark = step, (step, self.clock())

    def retune(self, step: int, at_once: bool = False) -> None:
        """auto, the exchange's rider: the step time since the last exchange into the measurements, and
        this rank's numbers out; their answer sets a new interval if the budget asks for one."""
        if not self.auto or self.off:
            return
        self._measure(step)
        if self._work_steps:
            self._steps.append(self._work / self._work_steps)
            self._work, self._work_steps = 0.0, 0
        if len(self._steps) < 2:  # the attempt's first measurement is its warm-up (twice as slow here): not alone
            return  # (every rank has measured as many)
        self.exchange.post([], [min(self._costs, default=0.0), min(self._steps)], self._decide)

    def _measure(self, step: int) -> float:
        """The steps since the mark into the work time (the clock read once, no copy among them); the clock."""
        now = self.clock()
        if self._mark is not None and step > self._mark[0]:
            self._work, self._work_steps = self._work + now - self._mark[1], self._work_steps + step - self._mark[0]
            self._mark = step, now
        return now

    def _decide(self, shared: List[float], own: List[List[float]]) -> None:
        """Every rank's numbers: the slowest rank's copy against the fastest rank's step."""
        cost, step_seconds, step = max(r[0] for r in own), min(r[1] for r in own), self.exchange.step
        if cost <= 0 or step_seconds <= 0 or self.off:
            return
        self._decided = True
        wanted = auto_interval(cost, step_seconds)
        if self.every * LOWER_AT < wanted <= self.every:
            return
        previous, self.every = self.every, wanted
        if self.comm.rank == 0:
            log.info(
                "Snapshots in memory: %s from step %d (a copy takes %s, a step %s)",
                _every(wanted, True),
                step,
                _seconds(cost),
                _seconds(step_seconds),
            )
            self._record(step, cost, previous_every_n_steps=previous, step_seconds=round(step_seconds, 6))

    def _record(self, step: int, seconds: float, **fields: Any) -> None:
        self.record(
            Event.SNAPSHOT_INTERVAL,
            step=step,
            every_n_steps=self.every,
            auto=self.auto,
            bytes=self.memory.bytes,
            segment=self.memory.segments.path.name,
            seconds=round(seconds, 6),
            **fields,
        )


def _nothing() -> None:
    pass


def auto_interval(copy_seconds: float, step_seconds: float) -> int:
    """snapshot.every_n_steps=auto's interval for these times: the smallest power of two at which a
    copy costs at most MEMORY_SHARE of the steps' time (a step's time without the copy)."""
    need = copy_seconds / (MEMORY_SHARE * step_seconds)
    return 1 << max(0, math.ceil(need) - 1).bit_length()


def _every(n: int, auto: bool) -> str:
    """'every 64 steps (auto)': how a person reads the interval in force."""
    return ("every step" if n == 1 else f"every {n} steps") + (" (auto)" if auto else "")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
