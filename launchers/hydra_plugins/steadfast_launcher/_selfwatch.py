"""Library mode's hang watchdog: a thread in the worker itself.

Under a platform no launcher of ours reads the heartbeats (docs/platforms.md). So each worker
watches its own progress counter: when it has not moved for `restart.hang_timeout_s`
(`restart.startup_timeout_s` before the first step), the worker writes its Python stacks to
logs/stacks/rank<r>.txt, records `hang_detected`, and kills itself with SIGKILL (exit status 137:
the platform restarts it, and Kubernetes' training operator counts 137 as retryable). A main
thread that holds the GIL so long that this thread cannot run meets faulthandler's timer instead,
re-armed at every look: it writes the stacks and ends the process (exit code 1).

What it cannot do that the launcher's watchdog does: ask the other ranks for their stacks and
name the suspect among them. Each hung rank ends by itself; the others follow when the platform
stops the group (torchrun) or their collectives fail.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

from steadfast.contract import events
from steadfast.contract.heartbeat import DONE_PHASE, STARTUP_PHASES, heartbeat
from steadfast.contract.schemas import RestartConf

from ._diagnosis import describe_frame, thread_frames
from ._watchdog import stacks_file

BACKSTOP_S = 30.0  # faulthandler's timer fires this long after the watchdog thread should have acted


class SelfWatch:
    def __init__(self, run_dir: Path, rank: int, restart: RestartConf) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.hang, self.startup = restart.hang_timeout_s, restart.startup_timeout_s or restart.hang_timeout_s
        self.poll = min(5.0, (self.hang or 1.0) / 10)
        self._stop = threading.Event()
        self._stacks: Optional[TextIO] = None
        self._task = threading.get_ident()  # the task's thread: the main thread, or Ray Train's training thread

    def start(self) -> "SelfWatch":
        if self.hang:
            path = stacks_file(self.run_dir, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stacks = open(path, "a")  # kept open: faulthandler's timer writes to its descriptor
            threading.Thread(target=self._watch, name="steadfast-selfwatch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._stacks is not None:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        last, moved = -1, time.monotonic()
        while not self._stop.wait(self.poll):
            beat = heartbeat()
            if beat is None or beat.phase == DONE_PHASE:
                continue
            now = time.monotonic()
            if beat.beats != last:
                last, moved = beat.beats, now
            limit = float((self.startup if beat.phase in STARTUP_PHASES else self.hang) or 0)
            if now - moved >= limit:
                self._end(beat.step, beat.phase, now - moved, limit)
            if self._stacks is not None:
                faulthandler.dump_traceback_later(limit - (now - moved) + BACKSTOP_S, file=self._stacks, exit=True)

    def _end(self, step: int, phase: str, still_s: float, limit: float) -> None:
        if self._stop.is_set():
            return
        where = None
        if self._stacks is not None:
            self._stacks.flush()
            start = self._stacks.tell()
            faulthandler.dump_traceback(file=self._stacks, all_threads=True)
            self._stacks.flush()
            where = describe_frame(next(iter(thread_frames(_read_from(self._stacks.name, start), self._task)), None))
        try:
            events.write(
                self.run_dir,
                events.HangDetected(
                    rank=self.rank,
                    step=step,
                    phase=phase,
                    seconds_without_progress=round(still_s, 1),
                    hang_timeout_s=limit,
                    where=where,
                    suspects=[self.rank],
                ),
            )
        finally:
            print(
                f"[rank {self.rank}] no progress for {still_s:.0f} s at step {step} ({phase}), over "
                f"restart.{'startup' if phase in STARTUP_PHASES else 'hang'}_timeout_s={limit:g}; stacks in "
                f"{stacks_file(self.run_dir, self.rank)}; ending this worker (SIGKILL) so that its platform restarts it",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""
