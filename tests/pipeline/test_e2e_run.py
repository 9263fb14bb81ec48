"""End to end through the real launcher: 2 workers, real signals, real checkpoint files."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from helpers import QUICK, committed_steps, event_of, events, run_dir, run_train, start_train, stop, summary, wait_for

pytestmark = pytest.mark.slow


def test_default_two_worker_run_completes_with_records(baseline: dict) -> None:
    s, folder = baseline["summary"], baseline["dir"]
    assert s["status"] == "completed" and s["epochs_completed"] == 4 and s["world_size"] == 2
    assert s["restarts"] == 0 and len(s["model_sha256"]) == 64 and s["final_loss"] > 0
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "logs/rank0.log", "logs/rank1.log"):
        assert (folder / name).is_file(), name
    assert committed_steps(folder)[-1] == s["global_step"]
    kinds = [e["event"] for e in events(folder)]
    assert kinds[0] == "launch" and "checkpoint_saved" in kinds and kinds[-1] == "job_completed"
    rows = [line for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert rows and all('"step"' in r and '"restart"' in r for r in rows)


def test_sigkill_after_first_checkpoint_restarts_and_finishes_exactly(tmp_path: Path, baseline: dict, backend: list[str]) -> None:
    # Rank 1 stops making progress at step 40 (after the first epoch's checkpoint at step 16);
    # this test then SIGKILLs it from outside, as a crash would.
    proc = start_train(tmp_path, *QUICK, *backend, "run.name=killed", "fault=hang_rank", "fault.rank=1", "fault.at_step=40")
    folder = run_dir(tmp_path, "killed")
    try:
        hung = wait_for(lambda: event_of(folder, "fault_fired"), 120, "rank 1 to reach step 40", proc)
        assert committed_steps(folder), "the first checkpoint should exist before the kill"
        os.kill(hung["pid"], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, stop(proc)
    finally:
        out = stop(proc)
    s = summary(folder)
    assert s["status"] == "completed", out
    assert s["restarts"] >= 1 and s["epochs_completed"] == 4
    assert event_of(folder, "resumed") is not None
    assert s["model_sha256"] == baseline["summary"]["model_sha256"]


def _finished(baseline: dict, cwd: Path) -> Path:
    """The finished baseline run, as its own command left it, in a folder of this test's."""
    folder = run_dir(cwd, "baseline")
    shutil.copytree(baseline["dir"], folder)
    return folder


def test_running_a_finished_command_again_trains_nothing(baseline: dict, tmp_path: Path) -> None:
    folder = _finished(baseline, tmp_path)
    before = len(events(folder))
    run_train(tmp_path, *QUICK, "run.name=baseline", check=True)
    new = events(folder)[before:]
    assert not [e for e in new if e["event"] in ("checkpoint_saved", "first_step")]
    assert any(e["event"] == "resumed" for e in new)
    assert summary(folder)["model_sha256"] == baseline["summary"]["model_sha256"]
    assert summary(folder)["global_step"] == baseline["summary"]["global_step"]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_resume_never_refuses_and_leaves_checkpoints_untouched(baseline: dict, tmp_path: Path) -> None:
    folder = _finished(baseline, tmp_path)
    ckpts = folder / "checkpoints"
    before = _tree_digest(ckpts)
    n_events = len(events(folder))
    proc = run_train(tmp_path, *QUICK, "run.name=baseline", "resume=never")
    assert proc.returncode != 0
    assert "resume=never" in proc.stderr and "outputs/baseline/checkpoints" in proc.stderr
    assert _tree_digest(ckpts) == before
    assert not [e for e in events(folder)[n_events:] if e["event"] == "attempt_started"]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.max_epochs=0", "trainer.max_epochs"),
        ("restart.max_restarts=-1", "restart.max_restarts"),
        ("checkpoint.every_n_epochs=0", "checkpoint.every_n_epochs"),
        ("trainer.foo=1", "trainer.foo"),
        ("backend.nproc_per_node=two", "backend.nproc_per_node"),
        ("backend=nope", "backend"),
        ("resume=sometimes", "resume"),
        ("data.batch_size=-4", "data.batch_size"),
    ],
)
def test_bad_overrides_fail_before_any_worker_starts(tmp_path: Path, override: str, needle: str) -> None:
    proc = run_train(tmp_path, override, timeout=60)
    assert proc.returncode != 0
    first = proc.stderr.strip().splitlines()[0]
    assert needle in first, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("outputs/*/events.jsonl")), "no worker may start"
