"""Stop requests: SIGTERM, SIGINT and SIGHUP only set a flag; the task acts on it at a step boundary.

In a worker, the ranks agree on the step to stop at, save it, and raise `StopRun`; the worker then
returns a `Stopped` value instead of its result, so no backend sees a failure or restarts
anything, and the launcher ends the job (exit code EXIT_PREEMPTED after SIGTERM). In the launcher,
the same flag tells its supervisor to forward the signal to the workers, and a backend's launch
that ended on purpose is a `Stopped` too (one of the launch's outcomes).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from enum import Enum
from types import FrameType
from typing import Any, Dict, Optional, TypedDict, Union

from .exits import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal went away


class StopReason(str, Enum):
    """Why a task stopped early on purpose (after it saved); the stop event it records is named so."""

    PREEMPTED = "preempted"  # a stop request: the same command continues (exit code EXIT_PREEMPTED)
    MEMORY_LIMIT = "memory_limit"  # trainer.max_rss_mb: not restarted, it would happen again
    ANOMALY_STOP = "anomaly_stop"  # anomaly.max_rollbacks: not restarted, a person looks first

    def __str__(self) -> str:
        return self.value


PREEMPTED = StopReason.PREEMPTED


class _StopState(TypedDict):
    signal: Optional[int]
    time: Optional[float]


_state: _StopState = {"signal": None, "time": None}


def _on_stop_signal(signum: int, frame: Optional[FrameType]) -> None:
    if _state["signal"] is None:
        _state["time"] = time.time()
        _state["signal"] = signum


def install_stop_handlers() -> Dict[signal.Signals, Any]:
    """SIGTERM, SIGINT and SIGHUP set the stop flag (main thread only); returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}


def ignore_stop_signals() -> None:
    """From now on SIGTERM/SIGINT/SIGHUP do nothing (a worker whose task is over; main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def restore_handlers(previous: Dict[signal.Signals, Any]) -> None:
    for sig, handler in previous.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(sig, handler)


def request_stop(signum: int) -> None:
    """Record a stop request as if `signum` had arrived."""
    _on_stop_signal(signum, None)


def stop_requested() -> Optional[int]:
    """The signal number of the first stop request in this process, or None."""
    return _state["signal"]


def stop_requested_at() -> Optional[float]:
    return _state["time"]


def clear_stop() -> None:
    _state.update({"signal": None, "time": None})


def signal_name(signum: Optional[int], unknown: str = "none") -> str:
    """SIGTERM for 15; `unknown` for no signal; "signal N" for a number that names none."""
    if not signum:
        return unknown
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class Stopped:
    """What a worker returns instead of its result when it stopped early on purpose, and the outcome
    of a launch that ended so.

    step: where it stopped; saved: whether that step is committed; message: one line for the person
    who runs the job; exit_code: the process's (EXIT_PREEMPTED for a stop request); signal: the stop
    request's signal number.
    """

    reason: StopReason
    step: Optional[int] = None
    saved: bool = False
    message: str = ""
    exit_code: int = EXIT_PREEMPTED
    signal: Optional[int] = None


class StopRun(Exception):
    """Raised by a task on every rank after it saved and agreed to stop (see `Stopped`)."""

    def __init__(
        self,
        reason: Union[StopReason, str],
        step: Optional[int],
        saved: bool,
        message: str,
        exit_code: int = EXIT_PREEMPTED,
        signum: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.marker = Stopped(StopReason(reason), step=step, saved=saved, message=message, exit_code=exit_code, signal=signum)
