"""Liveness: every worker rewrites its progress counter in HEARTBEAT_DIR/rank<r>; the launcher's
watchdog reads them.

The counter moves with the work (steps, checkpoint files, validation batches), never a clock
compared between hosts. The watchdog declares a rank hung when its counter has not moved for
`restart.hang_timeout_s` by the launcher's own clock, has every stuck worker write its Python
stacks (STACK_SIGNAL, `faulthandler`) to STACKS_DIR/rank<r>.txt, and kills it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any, Dict, Optional, TextIO, TypedDict

from .env import ENV_LAUNCH_ID, restart_count
from .files import HEARTBEAT_DIR, STACKS_DIR, read_regular

STACK_SIGNAL = signal.SIGUSR1  # makes a worker dump its stacks (faulthandler) without stopping it
DONE_PHASE = "done"  # a worker's last heartbeat phase: its task is over (shutting down, or waiting to be collected)
STARTUP_PHASES = ("start", "init", "restore")  # before a worker's first step: restart.startup_timeout_s applies
_RECORD_BYTES = 320
STOP_MARKER = (
    "stop"  # HEARTBEAT_DIR/stop.<launch id>: the launcher asked this launch's workers to stop (written before it signals them)
)


class _State(TypedDict):
    heartbeat: Optional[Heartbeat]
    stacks_file: Optional[TextIO]


_state: _State = {"heartbeat": None, "stacks_file": None}


class Heartbeat:
    """This rank's progress, in a fixed-size file rewritten in place by one pwrite per beat, so a
    reader never sees half a record. About 2 microseconds a beat: cheap enough for every step."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.fd = os.open(folder / f"rank{rank}", os.O_WRONLY | os.O_CREAT, 0o644)
        fixed = {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "restart": restart_count(),
            "launch": os.environ.get(ENV_LAUNCH_ID, ""),
        }
        self._head = json.dumps(fixed)[:-1]  # '{"rank": ..., "launch": "..."' without the closing brace
        self.beats, self.step, self.phase = 0, -1, "start"
        self.beat(-1, "start")

    def beat(self, step: int, phase: str = "train") -> None:
        self.beats += 1
        self.step, self.phase = step, phase
        record = f'{self._head}, "beats": {self.beats}, "step": {step}, "phase": "{phase}"}}'.encode()
        os.pwrite(self.fd, record[: _RECORD_BYTES - 1].ljust(_RECORD_BYTES - 1) + b"\n", 0)


def start_heartbeat(run_dir: Path, rank: int) -> Heartbeat:
    beat = _state["heartbeat"] = Heartbeat(run_dir / HEARTBEAT_DIR, rank)
    return beat


def heartbeat() -> Optional[Heartbeat]:
    """This process's heartbeat, when it runs as a worker of the launcher (None otherwise)."""
    return _state["heartbeat"]


def read_heartbeats(run_dir: Path) -> Dict[int, Dict[str, Any]]:
    """Every rank's last heartbeat record (rank -> record); unusable files are skipped."""
    out: Dict[int, Dict[str, Any]] = {}
    try:
        files = list((run_dir / HEARTBEAT_DIR).iterdir())
    except OSError:
        return out
    for path in files:
        data = read_regular(path, 4096)
        try:
            record = json.loads((data or b"").strip() or b"null")
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("pid"), int):
            out[record["rank"]] = record
    return out


def stop_marker(run_dir: Path, launch_id: str) -> Path:
    """The file whose presence says a stop signal to this launch's workers came from the launcher
    (a stop request to save and stop), not from a backend stopping its worker group."""
    return run_dir / HEARTBEAT_DIR / f"{STOP_MARKER}.{launch_id}"


def enable_stack_dumps(run_dir: Path, rank: int) -> Path:
    """STACK_SIGNAL makes this process append every thread's Python stack to STACKS_DIR/rank<r>.txt,
    and so does a fatal signal before it ends the process."""
    path = run_dir / STACKS_DIR / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    stacks: TextIO = open(path, "a")  # kept open: faulthandler writes to its descriptor from the signal handler
    _state["stacks_file"] = stacks
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
    # a fatal signal's stacks too (SIGSEGV, SIGABRT, ...): here rather than on the console, where
    # torch elastic's wrapper had sent them; the launcher names the crashing line from them
    faulthandler.enable(file=stacks, all_threads=True)
    return path
