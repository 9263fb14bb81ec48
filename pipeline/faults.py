"""Fault injection: rehearse recovery before a long run (`fault=kill_rank`, `fault=hang_rank`, ...).

A fault fires on rank `fault.rank` when it completes step `fault.at_step` (the save faults: in the
first checkpoint written at or after that step; only rank 0 writes), at most `fault.times`
times over the whole run: the count is kept in the run folder, so it survives restarts.
Every firing is recorded in events.jsonl before it happens.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

KINDS = ("none", "kill", "hang", "exception", "sigterm", "crash_in_save", "save_error", "corrupt_checkpoint")
SAVE_KINDS = ("crash_in_save", "save_error")
STEP_KINDS = ("kill", "hang", "exception", "sigterm")


class InjectedFault(RuntimeError):
    """Raised by fault=exception."""


class FaultInjector:
    def __init__(self, cfg: Any, rank: int, run_dir: Path, record_event: Callable[..., None]) -> None:
        self.cfg, self.rank, self.record_event = cfg, rank, record_event
        self.active = cfg is not None and cfg.kind != "none" and cfg.rank == rank
        self.counter = run_dir / "faults" / f"{cfg.kind}-rank{rank}-step{cfg.at_step}.count" if self.active else None

    def after_step(self, step: int) -> None:
        if self.active and step == self.cfg.at_step and self.cfg.kind in STEP_KINDS and self._claim():
            self._fire(step)

    def during_save(self, step: int, files_written: int) -> None:
        """Called by the checkpoint writer after each file of the save at `step`."""
        if self.active and step >= self.cfg.at_step and files_written == 1 and self.cfg.kind in SAVE_KINDS and self._claim():
            self._fire(step)

    def after_commit(self, step: int, path: Path) -> None:
        """fault=corrupt_checkpoint: damage the checkpoint just committed (flip a byte of its model)."""
        if self.active and step >= self.cfg.at_step and self.cfg.kind == "corrupt_checkpoint" and self._claim():
            self.record_event("fault_fired", fault=self.cfg.kind, rank=self.rank, step=step, path=str(path), pid=os.getpid())
            with open(path / "model.bin", "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))

    def _claim(self) -> bool:
        """Count one firing, unless the configured number already fired (over all restarts)."""
        assert self.counter is not None
        self.counter.parent.mkdir(exist_ok=True)
        fired = int(self.counter.read_text()) if self.counter.exists() else 0
        if self.cfg.times and fired >= self.cfg.times:
            return False
        self.counter.write_text(str(fired + 1))
        return True

    def _fire(self, step: int) -> None:
        kind = self.cfg.kind
        # Written straight to events.jsonl (not through rank 0) so any rank can report its fault.
        self.record_event("fault_fired", fault=kind, rank=self.rank, step=step, pid=os.getpid())
        if kind in ("kill", "crash_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "save_error":
            raise OSError(errno.ENOSPC, f"No space left on device (injected by fault=save_error at step {step})")
        elif kind == "exception":
            raise InjectedFault(f"fault=exception injected at step {step} on rank {self.rank}")
        elif kind == "hang":
            deadline = time.monotonic() + self.cfg.hang_s
            while time.monotonic() < deadline:  # alive but making no progress
                time.sleep(0.05)
