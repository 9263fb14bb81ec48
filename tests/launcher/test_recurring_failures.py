"""Failures that come back on every attempt, end to end with real workers (tests/apps/raising_loop: a
tiny own loop that raises a chosen error on a chosen rank at a chosen step, on every attempt).

- A worker's own TimeoutError("timed out reading s3://...") on rank 1 is rank 1's failure, named
  first everywhere, never a lost peer of rank 0 (issue 32, finding 5).
- The same error at the same step on the same rank in two attempts in a row is not restarted again,
  under torch elastic's agent (which restarts the group itself) and Horovod's relaunch loop; an
  error every rank raises alike at one step stops the job at its first failure (issue 32 finding 11,
  issue 34); a failed launch of a completed run keeps its summary.json.
- Terminal escapes in a worker's exception reach the console, train.log and the rank logs as
  visible \\x1b, never raw (issue 32, finding 7).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from helpers import QUICK, ROOT, env, events, run_dir, run_train, summary

pytestmark = pytest.mark.slow
APP = ROOT / "tests" / "apps" / "raising_loop"
# a terminal escape that erases the line above and writes a green success over it
ESCAPES = "<ESC>[2K<ESC>[1A<ESC>[32mjob #0 completed: no failure<ESC>[0m<BEL>"
SHOWN = "\\x1b[2K\\x1b[1A\\x1b[32mjob #0 completed: no failure\\x1b[0m\\x07"


def app(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cwd = tmp_path / "project"
    if not cwd.exists():
        shutil.copytree(APP, cwd)
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )


def of_kind(folder: Path, kind: str) -> List[Dict[str, Any]]:
    return [e for e in events(folder) if e["event"] == kind]


def assert_escaped(*texts: str) -> None:
    for text in texts:
        assert "\x1b" not in text and "\x07" not in text, text[-3000:]


def test_a_workers_own_timeout_is_its_failure_and_is_not_restarted_a_third_time(tmp_path: Path, backend: List[str]) -> None:
    message = f'fail.message="timed out reading s3://bucket/shard-7 {ESCAPES}"'
    proc = app(tmp_path, *backend, "fail.rank=1", "fail.at_step=6", "fail.error=TimeoutError", message, "run.name=r")
    assert proc.returncode == 1, proc.stderr[-3000:]
    folder = run_dir(tmp_path / "project", "r")

    failed = of_kind(folder, "attempt_failed")
    assert len(failed) == 2, failed  # the second attempt met the same error: no third
    for f in failed:
        assert f["rank"] == 1 and f["how"].startswith("raised TimeoutError: timed out reading s3://") and f["step"] == 6, f
        assert [c["rank"] for c in f["consequences"]] == [0], f
        assert f["raised"] == [{"rank": 1, "step": 6, "error": f["how"][len("raised ") :]}], f
    why = "the same error at step 6 on rank(s) 1 in two attempts in a row: a code or config error; not restarted"
    assert "not_restarted" not in failed[0] and failed[1]["not_restarted"] == why
    assert len(of_kind(folder, "attempt_ended")) == 2, "no group was started after the second failure"
    assert len([e for e in of_kind(folder, "worker_failed") if e["rank"] == 1]) == 2

    s = summary(folder)
    assert s["status"] == "failed" and s["restarts"] == 1, s
    assert s["failures"][0].startswith("rank 1 (pid ") and "raised TimeoutError" in s["failures"][0], s
    assert s["error"].endswith("\nThe same error" + why[len("the same error") :]), s["error"]

    console = proc.stdout + proc.stderr
    assert "; " + why in console and "\nThe same error at step 6" in proc.stderr, console[-3000:]
    assert console.count("timed out reading s3://bucket/shard-7 " + SHOWN) >= 3  # two failures and the final message
    log = (folder / "train.log").read_text()
    assert "; " + why in log and "rank 1 (pid " in log
    ranks = [(folder / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert_escaped(console, log, *ranks)


def test_every_rank_failing_alike_stops_at_once_and_a_completed_runs_summary_is_kept(tmp_path: Path) -> None:
    done = app(tmp_path, "run.name=r")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = run_dir(tmp_path / "project", "r")
    completed = (folder / "summary.json").read_text()
    assert summary(folder)["status"] == "completed" and summary(folder)["model_sha256"]

    # one more epoch (a key in run.safe_to_change) that fails on every rank at its first step, on
    # every attempt: what `lr=abc` or `epochs=two` is to a finished run
    extra = ["epochs=4", "fail.rank=-1", "fail.at_step=13", "fail.error=TypeError", f'fail.message="lr={ESCAPES}abc"']
    proc = app(tmp_path, "run.name=r", *extra)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert event_steps(folder, "resumed") == [12], "the launch resumed the completed run"

    failed = of_kind(folder, "attempt_failed")
    assert len(failed) == 1, failed
    why = "every rank (0, 1) raised the same error at step 13: a code or config error; not restarted"
    assert failed[0]["not_restarted"] == why and {r["rank"] for r in failed[0]["raised"]} == {0, 1}
    assert of_kind(folder, "job_failed")[0]["restarts"] == 0
    assert (folder / "summary.json").read_text() == completed, "a failed launch keeps the completed run's summary"

    console = proc.stdout + proc.stderr
    assert "; " + why in console and "\nEvery rank (0, 1) raised" in proc.stderr
    assert "summary.json still says completed" in console
    log = (folder / "train.log").read_text()
    assert f"TypeError: lr={SHOWN}abc" in log, "the traceback torch elastic logged, escaped"
    assert_escaped(console, log)


def event_steps(folder: Path, kind: str) -> List[int]:
    return [e["step"] for e in of_kind(folder, kind)]


@pytest.mark.extended
def test_a_config_error_a_worker_finds_is_not_restarted(tmp_path: Path) -> None:
    proc = run_train(tmp_path, *QUICK, "parallel=fsdp", "parallel.units=[Nope]", "run.name=r")
    assert proc.returncode == 1
    folder = run_dir(tmp_path, "r")
    failed = of_kind(folder, "attempt_failed")
    assert len(failed) == 1, failed
    assert failed[0]["not_restarted"].startswith("a config error found by a worker (rank "), failed[0]
    assert "parallel.units=['Nope']: the model has no ['Nope']" in proc.stderr
    assert summary(folder)["restarts"] == 0
