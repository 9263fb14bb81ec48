"""One clear end on the console (an own-loop app, tests/apps/user_code, `python train.py`): every
backend says how the job ended, its steps and loss, and where its summary and weights are; a
finished run says it has nothing to train; a single run never calls itself a sweep; Ctrl-C during
start-up says what happened, with the exit code it exits with; backend=local is a run of its own;
the snapshot cadence's decisions stay in the rank logs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, env, events, run_dir, summary

pytestmark = pytest.mark.slow
APP = ROOT / "tests" / "apps" / "user_code"
END = re.compile(r"job #0 \[[^\]]*\] (completed|already complete|stopped|failed)[^\n]*")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    return cwd


def launch(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def end(proc: subprocess.CompletedProcess) -> str:
    found = END.findall(proc.stdout + proc.stderr)
    assert len(found) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return END.search(proc.stdout + proc.stderr).group(0)  # type: ignore[union-attr]


def test_every_backend_ends_with_one_line_and_a_finished_run_trains_nothing(project: Path) -> None:
    first = launch(project, "snapshot=auto")
    folder = run_dir(project, "user_default")
    done = summary(folder)
    line = end(first)
    assert line.endswith(
        f"completed: {done['global_step']} steps, 1 epochs, final loss {done['final_loss']:.4g}; "
        "summary: outputs/user_default/summary.json, weights: outputs/user_default/model.safetensors"
    ), line
    console = first.stdout + first.stderr
    assert "Sweep" not in console
    assert "Snapshots in memory" not in console  # the cadence's decisions: in the rank log
    assert "Snapshots in memory" in (folder / "logs" / "rank0.log").read_text()

    again = end(launch(project, "snapshot=auto"))
    assert f"already complete: nothing to train ({done['global_step']} steps, 1 epochs)" in again, again

    local = launch(project, "backend=local")
    assert end(local).endswith("weights: outputs/user_backend=local/model.safetensors"), end(local)
    assert summary(run_dir(project, "user_backend=local"))["world_size"] == 1  # its own run, not the 2-worker one
    assert "Snapshots in memory" not in local.stdout + local.stderr


def test_ctrl_c_during_start_up_says_what_happened_and_the_exit_code(project: Path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) once the launch is recorded, before
    or (on a fast machine) just after the workers' first step: either way the console says so, a
    single run is not a sweep, and the exit code said is the one it exits with (130)."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", "epochs=50", "run.name=ctrl_c"],
        cwd=project,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    folder = run_dir(project, "ctrl_c")
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "launch" for e in events(folder)):
            assert proc.poll() is None and time.monotonic() < deadline, "the launch was never recorded"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "exit code 75" not in out and "Sweep" not in out, out[-3000:]
    line = END.search(out)
    assert line is not None and "stopped by SIGINT" in line.group(0) and "(exit code 130)" in line.group(0), out[-3000:]
    if not any(e["event"] == "first_step" for e in events(folder)):
        assert "stopped during start-up, before the first step: nothing to save" in out, out[-3000:]
