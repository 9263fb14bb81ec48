"""Liveness: every worker rewrites its progress counter in HEARTBEAT_DIR/rank<r>; the launcher's
watchdog reads them.

The counter moves with the work (steps, checkpoint files, validation batches), never a clock
compared between hosts. A step only counts in memory; a thread of the worker writes the count
within PUBLISH_S (`Heartbeat`). The watchdog declares a rank hung when its counter has not moved for
`restart.hang_timeout_s` by the launcher's own clock, has every stuck worker write its Python
stacks (STACK_SIGNAL, `faulthandler`) to STACKS_DIR/rank<r>.txt, and kills it.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import threading
import time
import weakref
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
# How far the file may trail a counted step, at most: the watchdog's timeouts are seconds, its supervisor
# reads every 0.1 s (launchers/.../_supervise.py POLL_S). A wake-up costs the worker a few us of CPU.
PUBLISH_S = 0.05
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
    """This rank's progress: a fixed-size record rewritten whole, in place, by one pwrite. It ends with
    a check, a CRC-32 of the rest: a reader that catches a write half-done sees the check fail and
    reads again (`parse_record`), so it never takes half a record for a whole one.

    `beat` writes at once: a new phase, a loop's own `run.beat`, a save's files, the beat before an
    injected fault fires and the last one (`done`). A training step only `count`s: two stores on the
    training thread, after the step's compute, where a system call and the record's formatting cost
    ~12-15 us of cold CPU (bench/NOTES.md); the heartbeat's thread (started by the first count) writes
    the count within PUBLISH_S when it moved since its last write. The count moves only with the work:
    a hung training thread stops it, and the thread writes nothing new. A rank hung in a call (a
    collective, a sleep, I/O) has its exact step written; one killed outright (SIGKILL, SIGSEGV) may
    leave a step up to PUBLISH_S older in the file (its own record of a failure, `worker_failed`, reads
    the count in memory), never older than its newest snapshot in memory (the snapshot cadence flushes the
    count before one is taken). Not a memory mapping: a file truncated under one kills the writer (SIGBUS),
    the trust model's rule for the snapshots' writers too.
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
        self._written = 0  # the beats count in the file
        # one write at a time, so an older record never lands after a newer one (a phase's after a count's)
        self._lock = threading.Lock()
        self._publisher: Optional[threading.Thread] = None  # the thread that writes counted steps
        _live.add(self)
        self.beat(-1, "start")

    def beat(self, step: int, phase: str = "train") -> None:
        """A beat written now (one pwrite): the file says this step and phase when it returns."""
        with self._lock:
            self.step = step
            self.beats += 1
            if phase != self.phase:
                self._lay_out(phase)
            self._write()

    def count(self, step: int, phase: str = "train") -> None:
        """A step's beat: counted in memory, written by the heartbeat's thread within PUBLISH_S (a new
        phase, or the first count, is written at once)."""
        if phase != self.phase or self._publisher is None:
            self._start_counting(step, phase)
            return
        # the step is stored before the count and read after it (_write): a count in the file never goes
        # with an older step than its own
        self.step = step
        self.beats += 1

    def flush(self) -> None:
        """The last count written now, when the file does not have it yet."""
        if self._written != self.beats:
            with self._lock:
                if self._written != self.beats:  # a beat may have written it while this waited
                    self._write()

    def _start_counting(self, step: int, phase: str) -> None:
        self.beat(step, phase)
        if self._publisher is None:
            self._publisher = threading.Thread(
                target=_publish, args=(weakref.ref(self),), name="steadfast-heartbeat", daemon=True
            )
            self._publisher.start()

    def _write(self) -> None:
        """The whole record, in one write: a worker of an earlier incarnation may still write the same
        file, and the file holds one writer's record. Called with the lock held."""
        # most writes change only the numbers: two formats and a CRC (the fixed part's CRC is kept)
        beats = self.beats
        step = self.step
        numbers = _NUMBERS % (beats, step)
        os.pwrite(self.fd, _WHOLE % (self._fixed, numbers, crc32(numbers, self._crc), self._pad), 0)
        self._written = beats

    def _lay_out(self, phase: str) -> None:
        """The record's parts for a new phase: the fixed part, then fixed-width numbers (JSON allows the
        spaces). The phase (a loop's own word, run.beat) is cut to PHASE_CHARS: the record always fits."""
        self.phase = phase
        self._fixed = f'{self._head}, "phase": {json.dumps(phase[:PHASE_CHARS])}, "beats": '.encode()
        self._crc = crc32(self._fixed)
        whole = _WHOLE % (self._fixed, _NUMBERS % (self.beats, self.step), 0, b"")
        self._pad = b" " * (RECORD_BYTES - 1 - len(whole)) + b"\n"


_live: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()  # this process's heartbeats: flushed at exit


def _publish(ref: "weakref.ref[Heartbeat]") -> None:
    """The heartbeat's thread: every PUBLISH_S, the count written when it moved (never otherwise: a
    write of its own would look like progress). Ends with its heartbeat, or when a write fails: then
    the next count writes at once, on the training thread, and raises there as a beat does."""
    while True:
        time.sleep(PUBLISH_S)
        beat = ref()
        if beat is None:
            return
        try:
            beat.flush()
        except OSError:
            beat._publisher = None
            return
        del beat


def _flush_all() -> None:
    """At the interpreter's exit: the last counts written (a Run's end writes `done` itself)."""
    for beat in list(_live):
        try:
            beat.flush()
        except OSError:
            pass


def _forget_in_child() -> None:
    """A forked child (a DataLoader's worker) has no heartbeat thread, and may have a lock the thread
    held at the fork: a new lock, and its exit writes nothing (its parent's record goes on)."""
    for beat in list(_live):
        beat._lock = threading.Lock()
        beat._publisher = None
    _live.clear()


atexit.register(_flush_all)
os.register_at_fork(after_in_child=_forget_in_child)


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
