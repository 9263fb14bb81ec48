"""The contract between the launch side (this plugin) and the worker side (any task function).

The launcher calls the Hydra task function on every rank with the job's config, resolved once
in the launcher process and identical for every rank and every restart. `HydraConfig.get()`
works in the worker as in a normal Hydra job. Besides the backend's own variables (torch
elastic's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT;
Horovod's HOROVOD_RANK, HOROVOD_SIZE, ...), every worker sees:

  STEADFAST_BACKEND   "torchrun", "horovod" or "local": which collective library to initialise
  STEADFAST_RUN_DIR   the job's output folder (absolute); the launcher created it
  STEADFAST_ATTEMPT   how many times the launcher itself relaunched this job (0 first)
  STEADFAST_LAUNCH_TIME  when the launcher started this job (seconds since the epoch)

A worker reports back through:
  - its return value (rank 0's becomes the job's return value, and must pickle);
  - an exception (the job failed; the launcher restarts it within `restart.max_restarts`);
  - raising `StopRun` after it saved (every rank, at the same step): the worker process then
    returns normally with a `Stopped` marker, so no backend sees a failure or restarts anything;
    the launcher stops the job and, for a preemption, exits with EXIT_PREEMPTED (75);
  - lines appended to EVENTS_FILE in the run folder with `append_event` (one JSON object a line).

Stop requests. SIGTERM, SIGINT and SIGHUP, to a worker or to the launcher, only set a flag
(`stop_requested()`); the task polls it at step boundaries, agrees with the other ranks on the
step to stop at, saves, and raises `StopRun`. The launcher forwards its own stop signal to the
workers that have registered (written their first heartbeat, which run_rank does right after
installing the handlers) and waits up to `restart.preemption_grace_s` before stopping them.

Liveness. Every worker writes its progress (`Heartbeat.beat`) into HEARTBEAT_DIR/rank<r>: a
counter that moves with the work (steps, checkpoint files, validation batches), never a clock
compared between hosts. The launcher's watchdog declares a rank hung when its counter has not
moved for `restart.hang_timeout_s` by the launcher's own clock, has every stuck worker write its
Python stacks (SIGUSR1, `faulthandler`) to STACKS_DIR/rank<r>.txt, and kills it.

This module is imported by both sides and must stay free of heavy imports.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from . import _runtime

ENV_BACKEND = "STEADFAST_BACKEND"
ENV_RUN_DIR = "STEADFAST_RUN_DIR"
ENV_ATTEMPT = "STEADFAST_ATTEMPT"
ENV_LAUNCH_TIME = "STEADFAST_LAUNCH_TIME"
ENV_LAUNCH_ID = "STEADFAST_LAUNCH_ID"  # tells this launch's heartbeats from an earlier launch's

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request (SIGTERM/SIGINT); run the same command again to continue

EVENTS_FILE = "events.jsonl"
CONFIG_FILE = "config.yaml"
HEARTBEAT_DIR = "heartbeats"  # one small file per rank: its progress counter
STACKS_DIR = "logs/stacks"  # rank<r>.txt: Python stacks dumped when the watchdog finds a rank stuck
STACK_SIGNAL = signal.SIGUSR1  # makes a worker dump its stacks (faulthandler) without stopping it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal went away
PREEMPTED = "preempted"  # Stopped.reason of a stop on request
DONE_PHASE = "done"  # a worker's last heartbeat phase: its task is over (shutting down, or waiting to be collected)


def run_dir() -> Path:
    """The run folder of the current job (set by the launcher)."""
    value = os.environ.get(ENV_RUN_DIR)
    if not value:
        raise RuntimeError(f"{ENV_RUN_DIR} is not set: run this task through the steadfast launcher")
    return Path(value)


def restart_count() -> int:
    """Restarts of this job so far: the launcher's relaunches plus the elastic agent's restarts."""
    return int(os.environ.get(ENV_ATTEMPT, "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def append_event(folder: str | os.PathLike[str], kind: str, **fields: Any) -> None:
    """Append one event to the run's events file.

    One `write` of one line on a file opened with O_APPEND, so lines written by the launcher
    and by rank 0 at the same time never interleave.
    """
    record = {"time": round(time.time(), 3), "event": kind, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(Path(folder) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# ---- stop requests (state in _runtime: see there) ---------------------------------------------
def _on_stop_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT/SIGHUP: only record the request; the task acts on it at its next step boundary."""
    if _runtime.stop["signal"] is None:
        _runtime.stop["time"] = time.time()
        _runtime.stop["signal"] = signum


def install_stop_handlers() -> Dict[int, Any]:
    """SIGTERM, SIGINT and SIGHUP set the stop flag (main thread only); returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}


def ignore_stop_signals() -> None:
    """From now on SIGTERM/SIGINT/SIGHUP do nothing (a worker whose task is over; main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def restore_handlers(previous: Dict[int, Any]) -> None:
    for sig, handler in previous.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(sig, handler)


def request_stop(signum: int) -> None:
    """Record a stop request as if `signum` had arrived (the launcher uses it too)."""
    _on_stop_signal(signum, None)


def stop_requested() -> Optional[int]:
    """The signal number of the first stop request in this process, or None."""
    return _runtime.stop["signal"]


def stop_requested_at() -> Optional[float]:
    return _runtime.stop["time"]


def clear_stop() -> None:
    _runtime.stop.update(signal=None, time=None)


def signal_name(signum: Optional[int]) -> str:
    try:
        return signal.Signals(signum).name if signum else "none"
    except ValueError:
        return f"signal {signum}"


# StopRun and Stopped live in _runtime, so that a re-executed contract module (Hydra's plugin
# scan) still names the very same classes: isinstance checks and unpickling keep working.
StopRun = _runtime.StopRun
Stopped = _runtime.Stopped


# ---- liveness --------------------------------------------------------------------------------
_HEARTBEAT_BYTES = 320


class Heartbeat:
    """This rank's progress, in a fixed-size file rewritten in place by one pwrite per beat, so a
    reader never sees half a record. About 2 microseconds a beat: cheap enough for every step."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.fd = os.open(folder / f"rank{rank}", os.O_WRONLY | os.O_CREAT, 0o644)
        fixed = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                 "restart": restart_count(), "launch": os.environ.get(ENV_LAUNCH_ID, "")}
        self._head = json.dumps(fixed)[:-1]  # '{"rank": ..., "launch": "..."' without the closing brace
        self.beats, self.step, self.phase = 0, -1, "start"
        self.beat(-1, "start")

    def beat(self, step: int, phase: str = "train") -> None:
        self.beats += 1
        self.step, self.phase = step, phase
        record = f'{self._head}, "beats": {self.beats}, "step": {step}, "phase": "{phase}"}}'.encode()
        os.pwrite(self.fd, record[: _HEARTBEAT_BYTES - 1].ljust(_HEARTBEAT_BYTES - 1) + b"\n", 0)


def start_heartbeat(folder: Path, rank: int) -> Heartbeat:
    _runtime.heartbeat = Heartbeat(folder / HEARTBEAT_DIR, rank)
    return _runtime.heartbeat


def heartbeat() -> Optional[Heartbeat]:
    """This process's heartbeat, when it runs as a worker of the launcher (None otherwise)."""
    return _runtime.heartbeat


def read_heartbeats(folder: Path) -> Dict[int, Dict[str, Any]]:
    """Every rank's last heartbeat record (rank -> record)."""
    out: Dict[int, Dict[str, Any]] = {}
    try:
        files = list((folder / HEARTBEAT_DIR).iterdir())
    except OSError:
        return out
    for path in files:
        try:
            record = json.loads(path.read_bytes().strip() or b"null")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "rank" in record:
            out[int(record["rank"])] = record
    return out


def enable_stack_dumps(folder: Path, rank: int) -> Path:
    """STACK_SIGNAL makes this process append every thread's Python stack to STACKS_DIR/rank<r>.txt."""
    path = folder / STACKS_DIR / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _runtime.stacks_file = open(path, "a")  # kept open: faulthandler writes to its descriptor from the signal handler
    faulthandler.register(STACK_SIGNAL, file=_runtime.stacks_file, all_threads=True, chain=False)
    return path


def atomic_write(path: "str | os.PathLike[str]", text: str) -> None:
    """Write-to-temp, fsync, rename, fsync the folder: readers see the old or the new file, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
