"""The metrics all-reduce is pipelined: the row of step s is written at the next log step, with
step s's numbers and time; an epoch's end, a stop and the end of the run read what is in flight."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from steadfast.distributed.comm import Comm, Pending
from steadfast.telemetry.metrics import Telemetry
from steadfast.telemetry.records import RunRecord, flush_rows


class CountingComm(Comm):
    """One process in a message laid out for two ranks (alone, the exchange starts no collective); counts
    the all-reduces started and waited for."""

    world_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.started = self.waited = 0

    def start_sum(self, tensor: torch.Tensor) -> Pending:
        self.started += 1

        def finish() -> torch.Tensor:
            self.waited += 1
            return tensor

        return Pending(finish)


def _rows(folder: Path) -> List[Dict[str, Any]]:
    flush_rows()  # the rows read so far, in the file (they are written by a thread of their own)
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _telemetry(folder: Path, comm: Comm, **kw: Any) -> Telemetry:
    return Telemetry(comm, RunRecord(folder, 0), "none", 10.0, 5, time.time(), 0, **kw)


def test_a_log_step_writes_the_previous_window_and_starts_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = CountingComm()
    t = _telemetry(tmp_path, comm)
    # the wall clock telemetry reads, one second per step: a row's time tells its step's from the step that wrote it
    clock = [1000.0]
    monkeypatch.setattr(sys.modules[Telemetry.__module__], "time", SimpleNamespace(time=lambda: clock[0]))
    for step in range(1, 11):
        clock[0] = 1000.0 + step
        t.add_loss(torch.tensor(float(step)))
        t.after_step(step, 0)
        if step == 5:
            assert _rows(tmp_path) == [] and comm.started == 1 and comm.waited == 0  # in flight, not waited for
    (row,) = _rows(tmp_path)  # step 5's row, written at step 10
    assert row["step"] == 5 and row["loss"] == 3.0 and row["time"] == 1005.0
    assert comm.started == 2 and comm.waited == 1
    assert t.end_epoch() == 5.5  # steps 6..10 were in flight: read at once, with their row
    assert [r["step"] for r in _rows(tmp_path)] == [5, 10] and _rows(tmp_path)[1]["loss"] == 8.0
    t.add_loss(torch.tensor(1.0))
    t.after_step(15, 1)
    t.close()  # the end of the run: the last window's row
    assert [r["step"] for r in _rows(tmp_path)] == [5, 10, 15] and comm.started == comm.waited


def test_the_memory_guard_answers_when_the_window_is_read(tmp_path: Path) -> None:
    t = _telemetry(tmp_path, CountingComm(), max_rss_mb=1.0)  # any process is over 1 MB
    answers = [t.after_step(step, 0) for step in range(1, 11)]
    assert answers[:9] == [None] * 9 and answers[9] is not None and answers[9][0] == 0  # step 5's window, read at 10
    t.after_step(15, 0)
    t.end_epoch()  # reads step 15's window: the answer comes with the next step
    assert t.after_step(16, 1) is not None and t.after_step(17, 1) is None


def test_an_error_unwinding_leaves_what_is_in_flight(tmp_path: Path) -> None:
    comm = CountingComm()
    t = _telemetry(tmp_path, comm)
    t.after_step(5, 0)
    try:
        raise RuntimeError("a peer is gone")
    except RuntimeError:
        t.close()
    assert comm.waited == 0 and _rows(tmp_path) == []


def test_a_checkpoint_taken_while_a_window_is_in_flight_keeps_the_epoch_loss_exact(tmp_path: Path) -> None:
    comm = CountingComm()
    t = _telemetry(tmp_path, comm)
    for step in range(1, 8):  # steps 1-5 in flight at step 7, 6-7 not yet logged
        t.add_loss(torch.tensor(float(step)))
        t.after_step(step, 0)
    state = t.state_dict()
    assert comm.waited == 0, "a checkpoint does not wait for the all-reduce in flight"
    assert state["count"] == 7 and float(state["window"]) == 28.0
    resumed = _telemetry(tmp_path / "resumed", CountingComm())
    (tmp_path / "resumed").mkdir()
    resumed.load_state_dict(state)
    for step in range(8, 11):
        resumed.add_loss(torch.tensor(float(step)))
        resumed.after_step(step, 0)
        t.add_loss(torch.tensor(float(step)))
        t.after_step(step, 0)
    assert resumed.end_epoch() == t.end_epoch() == 5.5
