"""Fault injection: rehearse recovery before a long run (`fault=kill_rank`, `fault=hang_rank`, ...).

A fault fires on rank `fault.rank` when it completes step `fault.at_step`, at most `fault.times`
times over the whole run: the count is kept in the run folder, so it survives restarts.
Every firing is recorded in events.jsonl before it happens.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

KINDS = ("none", "kill", "hang", "exception", "sigterm")


class InjectedFault(RuntimeError):
    """Raised by fault=exception."""


class FaultInjector:
    def __init__(self, cfg: Any, rank: int, run_dir: Path, record_event: Callable[..., None]) -> None:
        self.cfg, self.rank, self.record_event = cfg, rank, record_event
        self.active = cfg is not None and cfg.kind != "none" and cfg.rank == rank
        self.counter = run_dir / "faults" / f"{cfg.kind}-rank{rank}.count" if self.active else None

    def after_step(self, step: int) -> None:
        if not self.active or step != self.cfg.at_step:
            return
        assert self.counter is not None
        self.counter.parent.mkdir(exist_ok=True)
        fired = int(self.counter.read_text()) if self.counter.exists() else 0
        if self.cfg.times and fired >= self.cfg.times:
            return
        self.counter.write_text(str(fired + 1))
        self._fire(step, fired + 1)

    def _fire(self, step: int, nth: int) -> None:
        kind = self.cfg.kind
        # Written straight to events.jsonl (not through rank 0) so any rank can report its fault.
        self.record_event("fault_fired", fault=kind, rank=self.rank, step=step, nth=nth, pid=os.getpid())
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "exception":
            raise InjectedFault(f"fault=exception injected at step {step} on rank {self.rank}")
        elif kind == "hang":
            deadline = time.monotonic() + self.cfg.hang_s
            while time.monotonic() < deadline:  # alive but making no progress
                time.sleep(0.05)
