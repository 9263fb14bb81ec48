"""Failures point at the user's code (tests/apps/user_code, a script app run as `python train.py`):
a worker's traceback names the app's file, line and source wherever a person reads it (the
console, train.log, torch elastic's error.json), although the app's `__main__` travels pickled by
value; a module that replaced itself in sys.modules (`from torch.backends import cudnn`) travels;
an object that cannot be pickled is named in one line before any worker starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, env, run_dir, summary

APP = ROOT / "tests" / "apps" / "user_code"


def launch(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    return cwd


@pytest.mark.slow
def test_a_workers_traceback_names_the_apps_file_line_and_source(project: Path) -> None:
    proc = launch(project, "fail_at_step=3", "backend.nproc_per_node=1", "run.name=fails")
    assert proc.returncode != 0
    script = str(project / "train.py")
    source = 'raise ValueError(f"a bad batch at step {step}")'
    lines = (project / "train.py").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if source in text)
    frame = f'File "{script}", line {line}, in check_batch'
    console = proc.stdout + proc.stderr
    assert f"{script}:{line} in check_batch" in console, console[-3000:]  # the cause, in one line
    assert "<dynamic-code>" not in console
    folder = run_dir(project, "fails")
    log = (folder / "train.log").read_text()
    assert frame in log and source in log, log[-3000:]
    errors = list((folder / "logs").rglob("error.json"))
    assert errors, "torch elastic wrote no error.json"
    stack = json.loads(errors[0].read_text())["message"]["extraInfo"]["py_callstack"]
    assert frame in stack and source in stack, stack
    assert f"{script}:{line}" in summary(folder)["error"]
    assert (
        "job #0 [fail_at_step=3 backend.nproc_per_node=1 run.name=fails] failed after 0 restart(s); summary: outputs/fails/summary.json"
        in console
    )


def test_an_object_that_cannot_be_pickled_is_named_before_any_worker_starts(project: Path) -> None:
    """`LOCK = threading.Lock()` at module level, used in main: one line naming it, the function
    that refers to it (file:line) and what to do; no run folder."""
    proc = launch(project, "lock=true")
    assert proc.returncode != 0
    first = (proc.stderr or proc.stdout).strip().splitlines()[0]
    assert first.startswith("The task function cannot be sent to the workers: main (train.py:"), first
    assert "`LOCK`, a _thread.lock, which cannot be pickled" in first and "inside the function" in first, first
    assert "Traceback" not in proc.stderr
    assert not (project / "outputs").exists()
