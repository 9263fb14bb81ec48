"""The own-loop app of docs/own-loop.md as library mode's tests run it under each platform
(tests/platforms/test_platforms.py, test_kubernetes.py, test_ray.py): the app, its overrides, and what the
tests read of the workers while they run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from helpers import GUIDE, env, events, marked_files, summary, wait_for
from steadfast.contract.heartbeat import read_heartbeats
from steadfast.contract.pids import alive

# 192 steps, a snapshot in memory at every step, a checkpoint every 40 steps. The run is still
# outputs/own_default: epochs is in the app's run.safe_to_change, snapshot.* and checkpoint.* never
# name a run.
APP = ["epochs=6", "snapshot.every_n_steps=1", "checkpoint=every_n_steps", "checkpoint.every_n_steps=40"]


def make_app(folder: Path) -> Path:
    for path, text in marked_files(GUIDE).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def torchrun_cmd(*args: str) -> List[str]:
    script = Path(sys.executable).with_name("torchrun")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, *args]


def output(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return out or ""


def beat_of(folder: Path, rank: int, restart: int, step: int) -> Any:
    beat = read_heartbeats(folder).get(rank)
    ok = beat and beat.get("restart") == restart and beat.get("phase") == "train" and beat["step"] >= step
    return beat if ok else None


def kill(folder: Path, pid: int) -> int:
    """SIGKILL `pid`; once it is gone, the furthest step any rank's heartbeat shows (its restart
    starts seconds later: imports)."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, f"pid {pid} gone")
    return max(b["step"] for b in read_heartbeats(folder).values())


def assert_restored_from_memory(folder: Path, reached: List[int]) -> None:
    """Each restart restored the newest snapshot in memory: at most one step (the interval) behind
    the furthest step reached (from disk only when the kill landed on a checkpoint's step)."""
    restored = [e for e in events(folder) if e["event"] == "resumed"]
    assert len(restored) == len(reached), restored
    for got, furthest in zip(restored, reached):
        assert got["source"] == "memory" or got["step"] % 40 == 0, restored
        assert 0 <= furthest - got["step"] <= 1, (reached, restored)


def reference_summary(folder: Path) -> Dict[str, Any]:
    """The app under the steadfast launcher (`python train.py`), rank 1 killed at step 50 by the
    library's rehearsal: its summary, what every platform's run must end with (conftest's
    `platform_reference`, made once per session)."""
    app = make_app(folder)
    fault = ["fault=kill_rank", "fault.rank=1", "fault.at_step=50"]
    proc = subprocess.run(
        [sys.executable, "train.py", *APP, *fault], cwd=app, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (found,) = (app / "outputs").glob("*/summary.json")
    result = summary(found.parent)
    assert result["status"] == "completed" and result["restarts"] == 1, result
    return result
