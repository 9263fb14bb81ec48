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
from zlib import crc32

from .env import ENV_LAUNCH_ID, restart_count
from .files import HEARTBEAT_DIR, STACKS_DIR, read_regular

STACK_SIGNAL = signal.SIGUSR1  # makes a worker dump its stacks (faulthandler) without stopping it
DONE_PHASE = "done"  # a worker's last heartbeat phase: its task is over (shutting down, or waiting to be collected)
STARTUP_PHASES = ("start", "init", "restore")  # before a worker's first step: restart.startup_timeout_s applies
RECORD_BYTES = 512  # a record's fixed size, the file's: room for a 64-character host and launch id, and the phase
PHASE_CHARS = 40  # a phase's characters in the record (more are cut)
_CHECK = b', "check": "'  # the record's last field: the CRC-32 of the bytes before it, 8 hex digits
_READS = 5  # a reader's tries at a record torn by a beat being written
_NUMBERS = b'%20d, "step": %20d'  # a record's beats and step, fixed width: the padding after them stays the same
_WHOLE = b'%s%s, "check": "%08x"}%s'  # a record: the part before the numbers, the numbers, the check, the padding
STOP_MARKER = (
    "stop"  # HEARTBEAT_DIR/stop.<launch id>: the launcher asked this launch's workers to stop (written before it signals them)
)


class _State(TypedDict):
    heartbeat: Optional[Heartbeat]
    stacks_file: Optional[TextIO]


_state: _State = {"heartbeat": None, "stacks_file": None}


class Heartbeat:
    """This rank's progress: a fixed-size record rewritten whole, in place, by one pwrite per beat. It
    ends with a check, a CRC-32 of the rest: a reader that catches a beat half-written sees the check
    fail and reads again (`parse_record`), so it never takes half a record for a whole one. Most beats
    reuse the part before the numbers (fixed-width) and its CRC. Not a memory mapping: a file truncated
    under one kills the writer (SIGBUS), the trust model's rule for the snapshots' writers too
    (bench/NOTES.md: a mapping would save the system call, ~10 us of CPU a step here, cold).
    """

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
        self.beats, self.step, self.phase = 0, -1, ""
        self._fixed, self._crc, self._pad = b"", 0, b""  # the record's part before its numbers, its CRC; the padding after
        self.beat(-1, "start")

    def beat(self, step: int, phase: str = "train") -> None:
        # most beats change only the numbers: two formats and a CRC (a beat runs after the step's compute, with
        # the interpreter's caches cold: every operation counts). Always the whole record, in one write: a
        # worker of an earlier incarnation may still write the same file, and the file holds one writer's record
        self.beats += 1
        self.step = step
        if phase != self.phase:
            self._lay_out(phase)
        numbers = _NUMBERS % (self.beats, step)
        os.pwrite(self.fd, _WHOLE % (self._fixed, numbers, crc32(numbers, self._crc), self._pad), 0)

    def _lay_out(self, phase: str) -> None:
        """The record's parts for a new phase: the fixed part, then fixed-width numbers (JSON allows the
        spaces). The phase (a loop's own word, run.beat) is cut to PHASE_CHARS: the record always fits."""
        self.phase = phase
        self._fixed = f'{self._head}, "phase": {json.dumps(phase[:PHASE_CHARS])}, "beats": '.encode()
        self._crc = crc32(self._fixed)
        whole = _WHOLE % (self._fixed, _NUMBERS % (self.beats, self.step), 0, b"")
        self._pad = b" " * (RECORD_BYTES - 1 - len(whole)) + b"\n"


def parse_record(data: Optional[bytes]) -> Optional[Dict[str, Any]]:
    """One heartbeat record from a file's bytes, or None when they are not a whole one (torn by a beat
    being written, damaged, from another program): its check matches, it is a JSON object with an
    integer rank and pid."""
    body, check, tail = (data or b"").rstrip().rpartition(_CHECK)
    if not check or len(tail) != 10 or not tail.endswith(b'"}'):
        return None
    try:
        if int(tail[:8], 16) != crc32(body):
            return None
        record = json.loads(body + b"}")
    except ValueError:
        return None
    if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("pid"), int):
        return record
    return None


def read_heartbeat(path: Path) -> Optional[Dict[str, Any]]:
    """The record in one heartbeat file, read again while a beat being written tore it (its write takes
    microseconds); None when the file holds no whole record."""
    for _ in range(_READS):
        data = read_regular(path, 4096)
        record = parse_record(data)
        if record is not None or data is None:
            return record
    return None


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
        if path.name.startswith("rank"):
            record = read_heartbeat(path)
            if record is not None:
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
