"""Records that cannot be torn, flooded or spoofed (issue 32, findings 5, 6, 7, 9)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hydra_plugins.steadfast_launcher._diagnosis import RankEnd, diagnose
from steadfast.contract import events
from steadfast.contract.events import Event
from steadfast.contract.files import EVENTS_FILE


def test_a_users_timeout_error_is_its_own_failure() -> None:
    own = RankEnd(rank=1, pid=2, host="h", error="TimeoutError: timed out reading s3://b/k", error_at=10.0)
    peer = RankEnd(rank=0, pid=1, host="h", error="DistNetworkError: Connection closed by peer", error_at=10.5)
    found = diagnose([peer, own])
    assert found is not None and found.cause.rank == 1
    assert "stopped responding" not in found.line() and "raised TimeoutError" in found.line()


def test_terminal_escapes_are_escaped_in_the_diagnosis() -> None:
    end = RankEnd(rank=0, pid=1, host="h", error="ValueError: bad\x1b[2K\r\x1b[32mjob #0 completed", error_at=1.0)
    found = diagnose([end])
    assert found is not None and "\x1b" not in found.line() and "\r" not in found.line()
    assert "\x1b" not in str(end.record())


def test_a_huge_message_is_capped_and_later_records_still_read(tmp_path: Path) -> None:
    events.append(tmp_path, Event.WORKER_FAILED, rank=1, error="E: " + "x" * (2 << 20) + "TAIL")
    events.append(tmp_path, Event.JOB_FAILED, restarts=0)
    got = events.read(tmp_path)
    assert [r["event"] for r in got] == ["worker_failed", "job_failed"]
    assert len(got[0]["error"]) < 10000 and got[0]["error"].endswith("TAIL") and "cut" in got[0]["error"]


def test_an_oversized_line_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    events.append(tmp_path, Event.JOB_FAILED, restarts=0)
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(b'{"event": "job_failed", "time": 1, "x": "' + b"y" * (2 << 20) + b'"}\n')
    events.append(tmp_path, Event.JOB_COMPLETED, relaunches=0)
    assert [r["event"] for r in events.read(tmp_path)] == ["job_failed", "job_completed"]


def test_a_short_write_is_finished_and_a_torn_tail_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write

    def short(fd: int, data: Any) -> int:
        return real(fd, bytes(data)[: max(1, len(data) // 3)])

    monkeypatch.setattr(os, "write", short)
    events.append(tmp_path, Event.JOB_FAILED, restarts=0)
    monkeypatch.setattr(os, "write", real)
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(b'{"event": "job_fai')  # a record cut short by a full disk
    events.append(tmp_path, Event.JOB_COMPLETED, relaunches=0)
    assert [r["event"] for r in events.read(tmp_path)] == ["job_failed", "job_completed"]
