"""The hang watchdog: which ranks are stuck, which one is the suspect, and its end.

A rank whose progress counter (its heartbeat) has not moved for `restart.hang_timeout_s`, measured on
this launcher's clock, never by comparing clocks of hosts, is stuck (`restart.startup_timeout_s`
before its first step). Its peers soon stop moving too, waiting for it in a collective. Every stuck
worker is asked for its Python stacks (SIGUSR1 -> faulthandler, appended to logs/stacks/rank<r>.txt);
a rank whose main thread is not inside a collective is the suspect. One `hang_detected` event names
it, and the stuck workers are killed. The supervisor (_supervise) calls it from its look at the
workers; what happens next (a restart, a relaunch) is the backend's.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, TypeVar

from steadfast.contract import events
from steadfast.contract.files import STACKS_DIR
from steadfast.contract.heartbeat import DONE_PHASE, STACK_SIGNAL, STARTUP_PHASES
from steadfast.contract.pids import kill

from ._diagnosis import describe_frame, main_thread_frames, waits_in_collective
from ._logfiles import DETAILS

details = logging.getLogger(DETAILS)  # train.log only

STACKS_WAIT_S = 3.0  # the longest the watchdog waits for the stuck workers' stacks to land


class Watched(Protocol):
    """What the watchdog reads and marks of a worker the supervisor watches."""

    rank: int
    pid: int
    restart: int
    last_change: float  # monotonic, when its heartbeat last moved
    step: int
    phase: str
    handled: bool  # killed by the watchdog (or after a grace)
    hang: Optional[str]  # what the watchdog found: its suspicion, or "" (waiting in a collective)
    waits: bool  # the watchdog found it waiting in a collective for a hung rank (stuck or not yet)


W = TypeVar("W", bound=Watched)


def stacks_file(run_dir: Path, rank: int) -> Path:
    return run_dir / STACKS_DIR / f"rank{rank}.txt"


class Watchdog:
    def __init__(self, run_dir: Path, hang_timeout_s: Optional[float], startup_timeout_s: Optional[float], poll_s: float) -> None:
        self.run_dir, self.hang_timeout = run_dir, hang_timeout_s
        # declared hung when the counter has been still for this long: detection, which also waits for
        # the supervisor's next look, then stays within the timeout
        self.threshold = max(hang_timeout_s - poll_s, hang_timeout_s / 2) if hang_timeout_s else None
        startup = startup_timeout_s or hang_timeout_s
        self.startup_threshold = max(startup - poll_s, startup / 2) if self.threshold and startup else None

    def stuck(self, live: Sequence[W], now: float) -> List[W]:
        """The live workers whose progress has been still for too long (none when hang detection is off)."""
        if self.threshold is None or self.startup_threshold is None:
            return []
        return [
            w
            for w in live
            if w.phase != DONE_PHASE
            and now - w.last_change >= (self.startup_threshold if w.phase in STARTUP_PHASES else self.threshold)
        ]

    def handle(self, stuck: List[W], now: float, peers: Sequence[W] = ()) -> str:
        """Ask the stuck workers for their stacks, name the suspect (recorded, and on each worker's
        `hang`), kill them; returns the finding's message. `peers` (the other live workers) are asked
        for their stacks too: on a loaded machine a peer may already wait in its collective while its
        heartbeat moved too recently to count as stuck; such a peer is reported waiting, not killed."""
        stuck.sort(key=lambda w: w.rank)
        others = sorted((w for w in peers if w not in stuck and w.phase != DONE_PHASE), key=lambda w: w.rank)
        sizes: Dict[int, int] = {}
        for w in [*stuck, *others]:
            path = stacks_file(self.run_dir, w.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            header = (
                f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} watchdog: rank {w.rank} (pid {w.pid}, restart "
                f"{w.restart}) made no progress for {now - w.last_change:.1f} s; last step {w.step}, phase {w.phase} ====\n"
            )
            with open(path, "a") as f:
                f.write(header)
            sizes[w.rank] = path.stat().st_size
            kill(w.pid, STACK_SIGNAL)
        dumps = self._wait_for_stacks([*stuck, *others], sizes)
        frames = {w.rank: main_thread_frames(dumps.get(w.rank, "")) for w in [*stuck, *others]}
        suspects = [w for w in stuck if not waits_in_collective(frames[w.rank])] or stuck
        first = suspects[0]
        waiting = sorted(
            [w for w in stuck if w not in suspects] + [w for w in others if waits_in_collective(frames[w.rank])],
            key=lambda w: w.rank,
        )
        seconds = now - first.last_change
        where = describe_frame(frames[first.rank][0] if frames[first.rank] else None)
        message = (
            f"rank {first.rank} hung: no progress for {seconds:.1f} s at step {first.step} (phase {first.phase}), at {where}"
        )
        if len(suspects) > 1:
            message += f"; also stuck: rank(s) {', '.join(str(w.rank) for w in suspects[1:])}"
        if waiting:
            message += f"; rank(s) {', '.join(str(w.rank) for w in waiting)} waiting for it in a collective"
        elif others:
            message += f"; rank(s) {', '.join(str(w.rank) for w in others)} not seen waiting in a collective yet"
        stacks = [str(stacks_file(self.run_dir, w.rank)) for w in [*stuck, *others]]
        for w in stuck:
            w.hang = ""
        for w in waiting:  # a peer not yet stuck too: its counter was written last a poll or two after the suspect's
            w.waits = True
        for w in suspects:
            here = describe_frame(frames[w.rank][0] if frames[w.rank] else None)
            w.hang = (
                f"no progress for {now - w.last_change:.1f} s at step {w.step} (phase {w.phase}), at {here}; "
                f"stacks in {STACKS_DIR}/"
            )
        events.write(
            self.run_dir,
            events.HangDetected(
                rank=first.rank,
                step=first.step,
                phase=first.phase,
                seconds_without_progress=round(seconds, 2),
                hang_timeout_s=self.hang_timeout,
                restart=first.restart,
                where=where,
                suspects=[w.rank for w in suspects],
                waiting=[w.rank for w in waiting],
                stacks=stacks,
            ),
        )
        details.error("%s. Stacks: %s. Killing the stuck worker(s).", message, ", ".join(stacks))
        for w in stuck:
            w.handled = True
            kill(w.pid, signal.SIGKILL)
        return message

    def _wait_for_stacks(self, stuck: Sequence[Watched], sizes: Dict[int, int]) -> Dict[int, str]:
        """Wait until every stuck worker's dump has landed (its file stopped growing), up to STACKS_WAIT_S."""
        deadline = time.monotonic() + STACKS_WAIT_S
        seen: Dict[int, int] = {}
        while time.monotonic() < deadline:
            try:
                now_sizes = {w.rank: stacks_file(self.run_dir, w.rank).stat().st_size for w in stuck}
            except OSError:
                break
            grown = all(now_sizes[r] > sizes[r] for r in now_sizes)
            if grown and now_sizes == seen:
                break
            seen = now_sizes
            time.sleep(0.05)
        out = {}
        for w in stuck:
            try:
                with open(stacks_file(self.run_dir, w.rank), "rb") as f:
                    f.seek(sizes[w.rank])
                    out[w.rank] = f.read().decode(errors="replace")
            except OSError:
                out[w.rank] = ""  # unusable: no frames, the rank counts as not seen in a collective
        return out
