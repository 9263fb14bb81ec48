"""The resume check (`steadfast-verify`, steadfast/verify_recovery.py) on a loop of steps shaped like
nanoGPT's (examples/nanogpt: max_iters, random batches from a uint16 memmap, the learning rate by
iteration, gradient accumulation, a batch fetched ahead of the step, evaluation on rank 0).

Real launches: the check runs the app uninterrupted, then again with two workers SIGKILLed (at steps
its heartbeats show; the launcher restarts them) and a SIGTERM to the launcher (the launch stops with
75, the check runs the same command again). The example must come out bit for bit the same with no
state tracked by hand; its naive conversion (the batch fetched ahead drawn from the global RNG, the
data lines as the plain script has them) must be named: the first checkpoint that differs, the
objects that differ there, and what to suspect.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from helpers import ROOT, env, events, summary
from steadfast.checkpoint import manifest
from steadfast.checkpoint.compare import Diverged, compare, read_states, suspects

pytestmark = pytest.mark.slow
APP = ROOT / "examples" / "nanogpt"
TINY = [  # steps of about 10 ms; 32 steps between checkpoints
    "warmup_iters=10",
    "eval_interval=50",
    "eval_iters=4",
    "data.max_chars=40000",
    "block_size=32",
    "batch_size=16",
    "model.n_layer=1",
    "model.n_embd=48",
    "model.n_head=2",
    "checkpoint.every_n_steps=32",
    "restart.monitor_interval=0.1",
]


def verify(cwd: Path, app: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steadfast.verify_recovery", "--app", app, "--name", "check", *overrides],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=420,
    )


def test_the_nanogpt_shaped_loop_resumes_exactly_after_two_kills_and_a_sigterm(tmp_path: Path) -> None:
    # the SIGTERM at step 96 leaves 64 steps for the ranks' agreement to stop them (it took 26 here)
    proc = verify(tmp_path, "examples.nanogpt.train", *TINY, "max_iters=160", "lr_decay_iters=160")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    sent = re.findall(r"sent: (SIGKILL to rank \d|SIGTERM to the launcher) at step (\d+)", out)
    assert [s[0] for s in sent] == ["SIGKILL to rank 1", "SIGKILL to rank 0", "SIGTERM to the launcher"], out
    assert "faulted: launch 1 stopped on request (exit code 75); running the same command again" in out, out
    assert "RESULT: MATCH" in out and "every tracked state equal" in out, out
    folder = tmp_path / "outputs" / "verify_recovery" / "check" / "faulted"
    resumed = [e["step"] for e in events(folder) if e["event"] == "resumed"]
    assert len(resumed) == 3, resumed  # after each kill, and in the second launch
    assert summary(folder)["max_steps"] == 160 and "epochs_completed" not in summary(folder)
    # no state tracked by hand: the checkpoint holds the model, the optimizer and the loop's progress
    # (its step and the random batches' position), each rank its RNGs and metrics
    newest = manifest.committed(folder / "checkpoints")[0][1]
    states = read_states(newest)
    assert set(states.objects) == {"model", "optimizer", "progress"} and states.objects["progress"]["streams"] == [320]
    assert [set(r) for r in states.ranks] == [{"rng", "telemetry"}] * 2


def naive_copy(folder: Path) -> Path:
    """examples/nanogpt as the plain script draws its batches: get_batch("train") on the global RNG,
    the batch fetched ahead kept in X, Y (the data lines the guide changes, changed back)."""
    shutil.copytree(APP, folder)
    text = (folder / "train.py").read_text()
    naive, dropped = re.subn(r"\n *train_batches = run\.random_batches\(get_batch, \"train\"\).*", "", text)
    naive, drawn = re.subn(r"next\(train_batches\)", 'get_batch("train")', naive)
    assert (dropped, drawn) == (1, 2) and "train_batches" not in naive
    (folder / "train.py").write_text(naive)
    config = folder / "conf" / "config.yaml"
    config.write_text(config.read_text().replace("app: examples.nanogpt.train", "app: null"))  # a script now
    return folder


def test_the_check_names_what_diverged_in_the_naive_conversion(tmp_path: Path) -> None:
    app = naive_copy(tmp_path / "naive")
    proc = verify(app, "train.py", *TINY, "max_iters=100", "fault=kill_rank", "fault.rank=1", "fault.at_step=70")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    assert "RESULT: MISMATCH: the recovered run ended with different weights" in out, out
    first = re.search(r"first checkpoint that differs: step (\d+)", out)
    assert first and int(first.group(1)) > 64, out  # after the resume (the newest checkpoint before the kill: 64)
    assert "rank 0's rng: differs at 'torch'" in out and "rank 1's rng: differs at 'torch'" in out, out
    assert "model: differs at" in out and "optimizer: differs at" in out and "the same: progress" in out, out
    assert "suspect: the random number generators" in out and "a batch fetched ahead of the step" in out, out


# ---- the comparison's words, without processes ----------------------------------------------------------
def test_what_to_suspect_follows_what_diverged() -> None:
    def said(*names: str) -> List[str]:
        return suspects([Diverged(n, n, ["x"]) for n in names])

    (only,) = said("model", "optimizer")
    assert "a batch fetched ahead of the step and kept in a variable" in only and "a counter of your own" in only
    assert "global RNG" in said("rng", "model")[0]
    assert "run.step a different number of times" in said("progress")[0]
    assert any("your own object(s)" in line and "scheduler" in line for line in said("model", "scheduler"))
    streams = suspects([Diverged("progress", "progress", ["streams.0"])])
    assert "run.random_batches/run.stream" in streams[0]


def test_the_comparison_reads_keys_and_leaves_out_undrawn_generators(tmp_path: Path) -> None:
    import numpy as np
    import torch

    from steadfast.checkpoint.compare import States, undrawn

    def rng(seed: int, numpy_seed: int) -> dict:
        return {"torch": torch.manual_seed(seed).get_state(), "numpy": np.random.RandomState(numpy_seed).get_state()}

    model = {"w": torch.ones(3), "b": torch.tensor([float("nan")])}
    a = States(10, {"progress": {"global_step": 10}, "model": model}, [{"rng": rng(1, 5), "telemetry": {"window": 1.0}}])
    b = States(10, {"progress": {"global_step": 10}, "model": dict(model)}, [{"rng": rng(1, 6), "telemetry": {"window": 2.0}}])
    assert [d.name for d in compare(a, b).diverged] == ["rank 0's rng"]  # NaN equals itself; telemetry is left out
    older = States(5, {}, [{"rng": rng(0, 5)}])  # numpy the same at steps 5 and 10: never drawn, whatever it began as
    assert undrawn(older, a) == {(0, "numpy")}
    result = compare(a, b, undrawn(older, a))
    assert not result.diverged and result.same == ["progress", "rank 0's rng", "model"]
    b.objects["model"] = {"w": torch.tensor([1.0, 2.0, 1.0]), "b": model["b"]}
    assert [(d.name, d.keys) for d in compare(a, b, {(0, "numpy")}).diverged] == [("model", ["w"])]
