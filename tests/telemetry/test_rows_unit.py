"""Rank 0's metrics rows are written by a thread of their own (steadfast/telemetry/_rows.py): in the
order given, all of them in the file after a flush, a Run's end, the interpreter's exit and before a
fault kills the process; a failed write raises on the training thread; a forked child writes none."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from steadfast import faults
from steadfast.config import FaultConf, FaultKind
from steadfast.faults import FaultInjector
from steadfast.telemetry import _rows
from steadfast.telemetry.records import RunRecord

ROOT = Path(__file__).resolve().parents[2]


def _lines(folder: Path) -> List[Dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def idle_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows' thread starts but writes nothing: only the caller's thread does."""
    monkeypatch.setattr(_rows, "_write_rows", lambda ref, wake: None)


def test_rows_are_written_by_their_own_thread_in_the_order_given(tmp_path: Path) -> None:
    record = RunRecord(tmp_path, 0)
    writers: List[str] = []
    record.after = lambda row: writers.append(threading.current_thread().name)
    for step in range(1, 301):
        if step % 3:
            record.metrics(step=step, loss=float(step))
        else:  # built on the rows' thread, in its place
            record.later(lambda step=step: {"time": 1.0, "step": step, "built_by": threading.current_thread().name})
    deadline = time.monotonic() + 30
    while len(writers) < 300 and time.monotonic() < deadline:  # no flush: the thread writes them
        time.sleep(0.01)
    rows = _lines(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 301))
    assert all("time" in r for r in rows)
    assert set(writers) == {"steadfast-rows"} and len(writers) == 300  # the sinks get every row, there too
    assert {r["built_by"] for r in rows if "built_by" in r} == {"steadfast-rows"}
    record.close()


def test_rows_given_inside_held_go_together_and_a_record_writes_again_after_close(tmp_path: Path, idle_thread: None) -> None:
    record = RunRecord(tmp_path, 0)
    with record.held():
        for step in (1, 2, 3):
            record.metrics(step=step)
    assert _lines(tmp_path) == []  # handed over, the (idle) thread woken
    record.close()
    record.metrics(step=4)
    record.flush()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]


def test_other_ranks_write_no_rows(tmp_path: Path) -> None:
    record = RunRecord(tmp_path, 1)
    record.metrics(step=1)
    record.later(lambda: {"step": 2})
    record.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_too_many_rows_waiting_are_written_by_the_caller(tmp_path: Path, idle_thread: None) -> None:
    record = RunRecord(tmp_path, 0)
    for step in range(_rows.MAX_QUEUED + 1):
        record.metrics(step=step)
    assert len(_lines(tmp_path)) == _rows.MAX_QUEUED + 1


class _FailingOnce:
    """A file whose disk fills: its first write takes part of a row, the second fails, the next ones work."""

    def __init__(self, path: Path) -> None:
        self.real, self.writes = open(path, "ab", buffering=0), 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes == 1:
            return int(self.real.write(data[:5]))
        if self.writes == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(self.real.write(data))

    def close(self) -> None:
        self.real.close()


def test_a_failed_write_raises_on_the_callers_thread_and_loses_or_repeats_nothing(tmp_path: Path) -> None:
    record = RunRecord(tmp_path, 0)
    record.metrics(step=1)
    record.flush()
    assert record._rows is not None
    record._rows._file = _FailingOnce(tmp_path / "metrics.jsonl")  # type: ignore[assignment]
    record.metrics(step=2)  # the thread's write fails: it ends, the row kept
    thread = record._rows._thread
    if thread is not None:
        thread.join(10)
    assert record._rows._failed
    record.metrics(step=3)  # written now, on this thread (the disk has room again): nothing lost, nothing twice
    record.flush()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]
    record._rows._file, record._rows._failed = _FailingOnce(tmp_path / "metrics.jsonl"), True  # type: ignore[assignment]
    record._rows._thread = None
    with pytest.raises(OSError, match="No space left"):
        record.metrics(step=4)  # a write that fails on this thread raises here, as it always did
    record.flush()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]
    record.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_no_row_and_its_exit_writes_nothing(tmp_path: Path, idle_thread: None) -> None:
    record = RunRecord(tmp_path, 0)
    record.metrics(step=1)
    record.flush()
    record.metrics(step=2)  # queued (the thread idle) when the child is forked
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader's worker would never log, but if it did, nothing reaches the file
        try:
            record.metrics(step=99)
            record.flush()
            _rows.flush_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    record.flush()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2]


def test_the_interpreters_exit_writes_the_rows_left(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from steadfast.telemetry import _rows; from steadfast.telemetry.records import RunRecord\n"
        "_rows._write_rows = lambda ref, wake: None  # the thread writes nothing: the exit must\n"
        "r = RunRecord(Path(sys.argv[1]), 0)\n"
        "for s in range(50): r.metrics(step=s)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=120)
    assert [r["step"] for r in _lines(tmp_path)] == list(range(50))


def test_a_fault_that_kills_the_process_writes_the_rows_first(
    tmp_path: Path, idle_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = RunRecord(tmp_path, 0)
    for step in (1, 2, 3):
        record.metrics(step=step)
    in_file: List[List[int]] = []

    def kill(pid: int, signum: int) -> None:
        assert signum == signal.SIGKILL
        in_file.append([r["step"] for r in _lines(tmp_path)])

    monkeypatch.setattr(faults.os, "kill", kill)
    injector = FaultInjector(FaultConf(kind=FaultKind.kill, rank=0, at_step=3), 0, tmp_path, lambda *a, **k: None)
    injector.after_step(3)
    assert in_file == [[1, 2, 3]]
