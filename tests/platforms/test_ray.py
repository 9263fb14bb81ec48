"""docs/ray.md rehearsed for real (extended tier: the [ray] extra, which scripts/setup.sh's extended
tier installs): the own-loop app in the workers of a Ray Train TorchTrainer on a local Ray, a worker
SIGKILLed, Ray's FailureConfig restarting the group, the run ending with the weights of the app
under the steadfast launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Dict

import pytest
from platform_runs import APP, assert_restored_from_memory, beat_of, kill, make_app, output

from helpers import GUIDE, env, events, marked_files, run_dir, summary, wait_for

RAY_GUIDE = GUIDE.with_name("ray.md")
pytestmark = [
    pytest.mark.skipif(
        find_spec("ray") is None, reason="Ray is not installed: pip install 'steadfast[ray]' (setup.sh's extended tier)"
    ),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the TorchTrainer's 2 workers take a CPU each"),
]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.alone
def test_ray_train_with_a_worker_killed_ends_with_the_launchers_weights(
    tmp_path: Path, platform_reference: Dict[str, Any]
) -> None:
    """docs/ray.md's driver, `python ray_train.py ...`: a local Ray (its own ray.init()), a TorchTrainer
    of 2 workers each running the app as its rank, FailureConfig(max_failures=3); rank 1's worker
    SIGKILLed: Ray restarts both, the run resumes from the snapshot in memory and ends exact."""
    app = make_app(tmp_path)
    for path, text in marked_files(RAY_GUIDE).items():
        (app / path).write_text(text)
    folder = run_dir(app, "own_default")
    proc = subprocess.Popen(
        [sys.executable, "ray_train.py", *APP],
        cwd=app,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        beat = wait_for(lambda: beat_of(folder, 1, 0, 30), 240, "rank 1 past step 30 (Ray starts in 20-40 s here)", proc)
        reached = [kill(folder, beat["pid"])]
        code = proc.wait(timeout=300)
    finally:
        out = output(proc)
    assert code == 0, out[-5000:]
    done = summary(folder)
    assert done["status"] == "completed" and done["model_sha256"] == platform_reference["model_sha256"], (
        done,
        platform_reference,
    )
    assert done["restarts"] == 1 and done["failures"][0].startswith("rank 1 (pid "), done
    assert "killed by a signal" in done["failures"][0], done
    assert events(folder)[0]["platform"] == "ray", events(folder)[0]
    assert_restored_from_memory(folder, reached)
