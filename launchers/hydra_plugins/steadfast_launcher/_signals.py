"""Stop signals (SIGTERM, SIGINT, SIGHUP) in the launcher process: around a sweep, and during one launch."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

from steadfast.contract.heartbeat import read_heartbeats
from steadfast.contract.pids import alive, kill
from steadfast.contract.stop import STOP_SIGNALS, request_stop, signal_name, stop_requested

from ._supervise import HOST, mark_stop
from ._types import Interrupted


@contextlib.contextmanager
def handling_signals(handler: Callable[[int, Optional[FrameType]], None]) -> Iterator[Callable[[], None]]:
    """Route SIGTERM/SIGINT/SIGHUP to `handler` (main thread only); yields a function that
    installs it again (torch elastic's agent replaces the handlers while it runs); restores on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def install() -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, handler)

    install()
    try:
        yield install
    finally:
        for s, previous in saved.items():
            if previous is not None:
                signal.signal(s, previous)


class LaunchSignals:
    """SIGTERM/SIGINT/SIGHUP in the launcher during a launch. A stop request is passed on to the
    workers (the supervisor forwards it) and the launcher waits for them to save and stop. The
    launch is abandoned at once instead (an exception in the main thread, as torch elastic's own
    handler would do) when there is nothing to wait for: no worker of this launch has registered
    yet (the agent may be waiting in a rendezvous), on a second signal, or when the supervisor
    finds the launch overdue. An in-process backend (`local`) is never abandoned on the first
    signal: its worker is this thread, and it stops at its next step boundary."""

    def __init__(self, run_dir: Path, launch_id: str, in_process: bool) -> None:
        self.run_dir, self.launch_id, self.in_process = run_dir, launch_id, in_process
        self.count, self.force = 0, False
        self.forwarded: Set[int] = set()  # shared with the supervisor: every worker gets the signal once

    def install(self) -> Dict[signal.Signals, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in STOP_SIGNALS}

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        self.count += 1
        request_stop(signum)
        if self.force or self.count > 1:
            raise Interrupted(f"stopped by {signal_name(signum)}", signum=signum)
        if self.in_process:
            return
        workers = self._registered()
        if not workers:
            raise Interrupted(f"stopped by {signal_name(signum)}", signum=signum)
        mark_stop(self.run_dir, self.launch_id)
        for pid in workers:  # at once; the supervisor passes it on to workers that register later
            self.forwarded.add(pid)
            kill(pid, signum)

    def _registered(self) -> List[int]:
        return [
            int(b["pid"])
            for b in read_heartbeats(self.run_dir).values()
            if b.get("launch") == self.launch_id and b.get("host") == HOST and alive(int(b.get("pid", 0)))
        ]

    def interrupt_main(self) -> None:
        import _thread

        self.force = True
        _thread.interrupt_main(signal.Signals(stop_requested() or signal.SIGTERM))
