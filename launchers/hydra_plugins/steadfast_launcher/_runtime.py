"""Per-process state behind contract.py's functions (the stop flag, this worker's heartbeat, the
open stacks file). It lives in this underscore module because Hydra's plugin scan re-executes
every public module under hydra_plugins in place, which would reset state kept in contract.py."""
from typing import Any, Dict, Optional

EXIT_PREEMPTED = 75  # the same value as contract.EXIT_PREEMPTED

stop: Dict[str, Any] = {"signal": None, "time": None}
heartbeat: Any = None
stacks_file: Any = None


class StopRun(Exception):
    """Raised by a task on every rank after it saved and agreed to stop (see `Stopped`)."""

    def __init__(self, reason: str, step: Optional[int], saved: bool, message: str, exit_code: int = EXIT_PREEMPTED,
                 signum: Optional[int] = None) -> None:
        super().__init__(message)
        self.marker = Stopped(reason=reason, step=step, saved=saved, message=message, exit_code=exit_code, signal=signum)


class Stopped:
    """What a worker returns instead of its result when it stopped early on purpose.

    reason: PREEMPTED (a stop request; exit_code EXIT_PREEMPTED) or another word for a stop that
    must not be restarted (e.g. "memory_limit", exit_code 1); step: where it stopped; saved:
    whether that step is committed; message: one line for the person who runs the job; signal:
    the stop request's signal number. (A plain class: Hydra's plugin scan executes public modules
    in a way that breaks dataclasses.)
    """

    def __init__(self, reason: str, step: Optional[int], saved: bool, message: str, exit_code: int = EXIT_PREEMPTED,
                 signal: Optional[int] = None) -> None:
        self.reason, self.step, self.saved, self.message = reason, step, saved, message
        self.exit_code, self.signal = exit_code, signal

    def __repr__(self) -> str:
        return f"Stopped(reason={self.reason!r}, step={self.step}, saved={self.saved}, signal={self.signal})"
