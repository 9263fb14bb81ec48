"""Rank 0's metrics rows on their way to metrics.jsonl, written by a thread of their own.

Building, encoding and writing a row costs the training thread 10-30 us of cold CPU, a dozen rows at
once when a control-plane message brings a dozen windows (bench/probes/run_step_cost.py). The rows
are handed over instead, in order: a row, or the function that builds one from numbers that no
longer change. A thread woken once per hand-over (`wake`) encodes them and appends them to the file
in one write, then gives them to `after` (the sinks of logger.sinks), one row at a time so the
training thread never waits long for the interpreter. `flush` writes what is left on the caller's
thread: every row handed over before it is in the file, in order, when it returns (the end of a
Run, its summary, the sinks' end, a fault about to kill the process, a reader).

The pattern of the heartbeat's thread (steadfast/contract/heartbeat.py):
- a forked child (a DataLoader's worker) writes nothing, and its exit writes nothing (the file is
  unbuffered: no row inherited half-written is written twice);
- the interpreter's exit writes what is left (atexit);
- a write that fails ends the thread with what it had not written kept: the next hand-over or flush
  writes on the caller's thread and raises there, as every write did when it was the training
  thread's own (a full disk stops the run as before).
At most MAX_QUEUED rows wait: past that the caller writes them itself (a disk slower than the rows).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO, Callable, Deque, Dict, List, Optional, Union

Row = Dict[str, Any]
Item = Union[Row, Callable[[], Optional[Row]]]  # a row, or what builds it (None: no row after all)
MAX_QUEUED = 4096
IDLE_S = 1.0  # how often an idle thread looks whether its writer is gone


class RowWriter:
    def __init__(self, path: Path, after: Optional[Callable[[Row], None]] = None) -> None:
        self.path, self.after = path, after
        self._queued: Deque[Item] = deque()  # handed over, not yet encoded
        self._unwritten = b""  # encoded, not yet in the file (a write that failed)
        self._rows: List[Row] = []  # in the file, not yet given to `after`
        self._file: Optional[BinaryIO] = None
        self._lock = threading.Lock()  # one writer at a time: rows reach the file in the order handed over
        self._wake: "queue.SimpleQueue[bool]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._failed = False  # the thread's write failed: the caller's thread writes next
        self._child = False  # a forked copy: writes nothing
        _live.add(self)

    def add(self, item: Item) -> None:
        """A row for the file, written after every row added before it (call `wake` to have it written)."""
        if not self._child:
            self._queued.append(item)

    def wake(self) -> None:
        """Have the rows added so far written soon: by the thread, or by the caller after the thread's
        write failed (it raises here if it fails again) or when too many rows wait."""
        if self._child or not self._queued:
            return
        if self._failed or len(self._queued) > MAX_QUEUED:
            self.flush()  # raises what made the thread's write fail, if it fails again
            self._failed = False
        if self._thread is None:
            self._thread = threading.Thread(
                target=_write_rows, args=(weakref.ref(self), self._wake), name="steadfast-rows", daemon=True
            )
            self._thread.start()
        self._wake.put(True)

    def flush(self) -> None:
        """Every row added so far in the file (and given to `after`) when this returns."""
        if not self._child:
            with self._lock:
                while self._queued or self._unwritten or self._rows:
                    self._write_one()

    def close(self) -> None:
        """Flush, end the thread and close the file (a later row opens it again)."""
        self.flush()
        if self._thread is not None:
            self._thread = None
            self._wake.put(False)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write_one(self) -> None:
        """With the lock held: the next queued row into the file, then to `after` (what a failed write left first)."""
        if not self._unwritten and not self._rows:
            item = self._queued[0]
            row = item() if callable(item) else item
            self._queued.popleft()
            if row is None:
                return
            self._unwritten, self._rows = (json.dumps(row) + "\n").encode(), [row]
        if self._unwritten:
            if self._file is None:
                self._file = open(self.path, "ab", buffering=0)  # unbuffered: nothing a fork could write twice
            while self._unwritten:
                n = self._file.write(self._unwritten)
                self._unwritten = self._unwritten[n or 0 :]
        rows, self._rows = self._rows, []
        if self.after is not None:
            for row in rows:
                self.after(row)


def _write_rows(ref: "weakref.ref[RowWriter]", wake: "queue.SimpleQueue[bool]") -> None:
    """The rows' thread: woken by a hand-over, writes what is queued a row at a time (letting the
    training thread run between rows); ends with its writer, its close, or a failed write."""
    me = threading.current_thread()
    while True:
        try:
            wake.get(timeout=IDLE_S)
        except queue.Empty:
            pass
        writer = ref()
        if writer is None or writer._thread is not me:
            return
        try:
            while writer._queued or writer._unwritten or writer._rows:
                with writer._lock:
                    if writer._queued or writer._unwritten or writer._rows:
                        writer._write_one()
                time.sleep(0)  # the interpreter to the training thread if it waits for it
        except Exception:  # noqa: BLE001 - the caller's thread writes it again, and raises there (RowWriter.wake)
            writer._failed, writer._thread = True, None
            return
        del writer


_live: "weakref.WeakSet[RowWriter]" = weakref.WeakSet()  # this process's writers: flushed at exit


def flush_all() -> None:
    """At the interpreter's exit, and before a fault kills the process: the rows handed over, written."""
    for writer in list(_live):
        try:
            writer.flush()
        except OSError:
            pass


def _forget_in_child() -> None:
    """A forked child writes no row, and its exit writes nothing (its parent's rows go on)."""
    for writer in list(_live):
        writer._child = True
        writer._lock = threading.Lock()  # the thread may have held it at the fork
        writer._queued, writer._unwritten, writer._rows, writer._thread = deque(), b"", [], None
    _live.clear()


atexit.register(flush_all)
os.register_at_fork(after_in_child=_forget_in_child)
