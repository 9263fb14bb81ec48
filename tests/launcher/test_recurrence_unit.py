"""Failures that would come back on every attempt, in isolation: the launcher's rule
(`_diagnosis.recurrence`), what the worker side marks as recurring (contract/failures.py), a failed
launch that keeps a completed run's summary, and the escaping of what a worker wrote. End to end:
tests/launcher/test_recurring_failures.py."""

from __future__ import annotations

import errno
import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from torch import nn

from hydra_plugins.steadfast_launcher._diagnosis import RankEnd, raised, recurrence
from hydra_plugins.steadfast_launcher._logfiles import _Printable, _PrintableStream
from steadfast.contract import events, failures, summary
from steadfast.contract.summary import Status
from steadfast.distributed import parallel

BUG = "ValueError: a bug"
CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"


def end(rank: int, error: Optional[str] = None, step: int = 6, at: float = 1.0, **kw: Any) -> RankEnd:
    fields: Dict[str, Any] = {"exit_code": 1, **kw}
    return RankEnd(rank=rank, pid=100 + rank, host="vm", step=step, error=error, error_at=at, **fields)


def same_again(before: List[RankEnd], now: List[RankEnd]) -> Optional[str]:
    """The rule on `now`, after an attempt that failed with `before` (its record read back from JSON)."""
    return recurrence(now, json.loads(json.dumps(raised(before))))


def test_the_same_error_at_the_same_step_on_the_same_rank_twice_is_not_restarted() -> None:
    first = [end(0, CLOSED, at=2.0), end(1, BUG)]
    assert recurrence(first, None) is None, "a first failure of one rank may be cured by a restart"
    why = same_again(first, [end(0, CLOSED, at=2.0), end(1, BUG)])
    assert why == "the same error at step 6 on rank(s) 1 in two attempts in a row: a code or config error; not restarted"


@pytest.mark.parametrize(
    "now",
    [
        [end(0, CLOSED, at=2.0), end(1, BUG, step=7)],  # another step
        [end(0, CLOSED, at=2.0), end(1, "ValueError: another bug")],  # another error
        [end(0, BUG), end(1, CLOSED, at=2.0)],  # another rank
        [end(0, CLOSED, at=2.0), end(1, None, exit_code=-9)],  # a signal: not an error the worker recorded
    ],
)
def test_a_different_failure_the_next_time_is_restarted(now: List[RankEnd]) -> None:
    assert same_again([end(0, CLOSED, at=2.0), end(1, BUG)], now) is None


def test_every_rank_raising_the_same_error_at_one_step_is_not_restarted_the_first_time() -> None:
    why = recurrence([end(0, "TypeError: '<' not supported"), end(1, "TypeError: '<' not supported", at=1.1)], None)
    assert why == "every rank (0, 1) raised the same error at step 6: a code or config error; not restarted"
    assert recurrence([end(0, BUG)], None) is None, "one rank alone is not every rank of a group"
    assert recurrence([end(0, BUG), end(1, BUG, step=7)], None) is None, "not at the same step"


def test_only_lost_peers_or_a_hang_are_never_called_recurring() -> None:
    assert recurrence([end(0, CLOSED), end(1, CLOSED)], None) is None
    hung = [end(0, None, hung=True, suspect=True, hang="no progress"), end(1, BUG)]
    assert same_again(hung, hung) is None


def test_an_error_its_code_knew_to_recur_is_not_restarted_the_first_time() -> None:
    why = recurrence([end(0, "CheckpointError: ...", recurs="the disk is full (a checkpoint save found no space left)")], None)
    assert why is not None and why.startswith("the disk is full (a checkpoint save found no space left) (rank 0 at step 6)")
    assert why.endswith("not restarted")


# ---- what the worker side marks ----------------------------------------------------------------------
def test_a_full_disk_under_a_save_is_marked_and_other_errors_are_not() -> None:
    class CheckpointError(RuntimeError):
        pass

    def save(cause: OSError) -> None:
        with failures.recurs_when_disk_full("a checkpoint save"):
            try:
                raise cause
            except OSError as exc:
                raise CheckpointError("saving checkpoint step 24 failed; step_000000018 is intact") from exc

    for code in (errno.ENOSPC, errno.EDQUOT):
        with pytest.raises(CheckpointError) as full:
            save(OSError(code, "No space left on device"))
        assert failures.recurs(full.value) == "the disk is full (a checkpoint save found no space left)"
    with pytest.raises(CheckpointError) as other:
        save(OSError(errno.EIO, "I/O error"))
    assert failures.recurs(other.value) is None
    assert failures.recurs(RuntimeError("x")) is None


def test_a_config_error_a_worker_finds_is_marked_and_still_a_value_error() -> None:
    with pytest.raises(ValueError) as found:
        parallel.units(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["Nope"])
    assert "parallel.units=['Nope']" in str(found.value)
    assert failures.recurs(found.value) == "a config error found by a worker"
    try:
        try:
            raise found.value
        except ValueError as exc:
            raise RuntimeError("setup failed") from exc
    except RuntimeError as wrapped:
        assert failures.recurs(wrapped) == "a config error found by a worker", "found through the chain of causes"


# ---- a completed run's summary is kept -------------------------------------------------------------
def _summary(folder: Path, status: Status, since: float) -> Dict[str, Any]:
    return summary.write(
        folder, status, since=since, restarts=0, wall_seconds=1.0, error="boom" if status is Status.FAILED else None
    )


def test_a_failed_launch_never_replaces_a_completed_summary(tmp_path: Path) -> None:
    events.write(tmp_path, events.TrainingCompleted(step=12, model_sha256="ab" * 32, result={"model_sha256": "ab" * 32}))
    done = _summary(tmp_path, Status.COMPLETED, since=0.0)
    before = (tmp_path / "summary.json").read_text()
    assert done["status"] == "completed" and done["model_sha256"] == "ab" * 32
    said = _summary(tmp_path, Status.FAILED, since=0.0)
    assert said == done and (tmp_path / "summary.json").read_text() == before
    # a stop on request still says where the run stands (the same command continues it)
    assert _summary(tmp_path, Status.PREEMPTED, since=0.0)["status"] == "preempted"
    assert _summary(tmp_path, Status.FAILED, since=0.0)["status"] == "failed", "only a completed summary is kept"


# ---- what a worker wrote, escaped ----------------------------------------------------------------------
def test_log_records_and_copied_output_show_control_characters_escaped() -> None:
    try:
        raise TimeoutError("timed out \x1b[2K\x1b[1Ajob done\x07")
    except TimeoutError:
        record = logging.LogRecord(
            "torch.distributed.elastic", logging.ERROR, __file__, 1, "failed: %s", ("\x1b[31m",), sys.exc_info()
        )
    assert _Printable().filter(record)
    text = logging.Formatter().format(record)
    assert "\x1b" not in text and "\x07" not in text
    assert "failed: \\x1b[31m" in text and "TimeoutError: timed out \\x1b[2K\\x1b[1Ajob done\\x07" in text
    assert "\n" in text, "newlines kept"

    class Sink:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> int:
            self.text += text
            return len(text)

    sink = Sink()
    _PrintableStream(sink).write("[1]<stderr>:x\x1b[2Ky\n")  # type: ignore[arg-type]
    assert sink.text == "[1]<stderr>:x\\x1b[2Ky\n"
