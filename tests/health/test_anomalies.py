"""Failures that crash nothing, end to end with real workers (issue 36): a NaN loss and a loss spike
on one rank of two are found at the same step on every rank, rolled back with the offending batch
skipped and recorded, and the run completes; a re-run gives the same weights, and so does a run
killed after its rollback; no committed checkpoint holds a non-finite value; a bit flipped in one
replica is found and the run ends with the weights of a run that never had it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    QUICK,
    ROOT,
    env,
    event_of,
    events,
    run_dir,
    run_train,
    start_train,
    stop,
    summary,
    wait_for,
)
from steadfast.contract.heartbeat import read_heartbeats

pytestmark = pytest.mark.slow

# 64 steps an epoch, a snapshot in memory every step, the NaN early: a kill lands after the rollback
# and in the same epoch, so the resume skips the same samples again
NAN = [
    *QUICK,
    "data.num_samples=2048",
    "trainer.max_epochs=3",
    "snapshot=every_step",
    "fault=nan_loss",
    "fault.rank=1",
    "fault.at_step=10",
]


def went_back(folder: Path) -> Dict[int, List[str]]:
    """Each rank's log lines that say it went back (every rank logs the rollback it took part in)."""
    return {
        r: [line for line in (folder / "logs" / f"rank{r}.log").read_text().splitlines() if "every rank went back" in line]
        for r in (0, 1)
    }


def nonfinite_in_checkpoints(folder: Path) -> List[str]:
    bad = []
    for state in sorted((folder / "checkpoints").glob("step_*/state.bin")):
        for name, t in load_file(str(state)).items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{state.parent.name}:{name}")
    return bad


def test_a_nan_loss_is_rolled_back_skipped_and_a_kill_after_it_resumes_exactly(tmp_path: Path) -> None:
    run_train(tmp_path, *NAN, "run.name=ref", check=True)
    ref = run_dir(tmp_path, "ref")
    back = event_of(ref, "anomaly")
    assert back is not None and back["anomaly"] == "nonfinite_loss" and back["step"] == 10 and back["ranks"][0] == 1, back
    assert back["action"] == "rolled_back" and "value" not in back, back
    assert back["restored_step"] <= 9 and back["agreed_at"] >= 10 and back["source"] == "memory", back
    epoch, first, samples, first_batch, batches = back["skipped"]
    assert (epoch, samples, first_batch, batches) == (0, 32, 9, 1) and len(back["samples"]) == 32, back
    # every rank went back at the same step, once
    said = went_back(ref)
    assert len(said[0]) == len(said[1]) == 1, said
    assert re.sub(r"^\[.*?\]\[rank \d\]", "", said[0][0]) == re.sub(r"^\[.*?\]\[rank \d\]", "", said[1][0]), said
    s = summary(ref)
    assert s["status"] == "completed" and s["rollbacks"] == 1 and s["skipped_samples"] == 32, s
    assert not nonfinite_in_checkpoints(ref)

    proc = start_train(tmp_path, *NAN, "run.name=killed")
    folder = run_dir(tmp_path, "killed")
    try:
        back = wait_for(lambda: event_of(folder, "anomaly"), 120, "the rollback", proc)

        def past_it() -> Any:
            beat = read_heartbeats(folder).get(0)
            return beat if beat and beat.get("restart") == 0 and beat["step"] >= back["agreed_at"] + 4 else None

        os.kill(wait_for(past_it, 60, "rank 0 past the rollback", proc)["pid"], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0
    finally:
        out = stop(proc)
    resumed = [e for e in events(folder) if e["event"] == "resumed"]
    assert resumed and resumed[-1]["restart"] == 1, out[-3000:]
    assert summary(folder)["model_sha256"] == s["model_sha256"], out[-3000:]
    assert summary(folder)["skipped_samples"] == 32 and not nonfinite_in_checkpoints(folder)


def test_a_bit_flipped_in_one_replica_is_found_and_the_run_ends_as_one_that_never_had_it(tmp_path: Path, baseline: dict) -> None:
    every = ["anomaly.fingerprint_every_n_steps=4", "trainer.stop_check_every_n_steps=1"]  # found at the next fingerprint
    run_train(tmp_path, *QUICK, "run.name=r", "fault=bitflip", "fault.at_step=20", *every, check=True)
    folder = run_dir(tmp_path, "r")
    flipped = event_of(folder, "fault_fired")
    back = event_of(folder, "anomaly")
    assert flipped["step"] == 20 and flipped["rank"] == 1
    # two ranks: no majority to tell which one is wrong, so every rank goes back to where they agreed
    assert back is not None and back["anomaly"] == "divergence" and back["action"] == "rolled_back", back
    assert back["tensor"] == flipped["tensor"] and back["ranks"] == [0, 1] and len(back["hosts"]) == 2, back
    assert back["step"] == 20 and back["agreed_at"] <= 24 and back["restored_step"] <= 20 and "skipped" not in back, back
    s = summary(folder)
    assert s["status"] == "completed" and s["model_sha256"] == baseline["summary"]["model_sha256"], s


LOOP = ROOT / "tests" / "apps" / "anomaly_loop"


def test_a_loss_spike_in_an_own_loop_is_rolled_back_and_its_samples_never_trained(tmp_path: Path) -> None:
    cwd = tmp_path / "project"
    shutil.copytree(LOOP, cwd)
    # the moving average takes its first 64 steps when they end (watch.BLOCK): the spike after them, in epoch 2
    overrides = ["anomaly=spikes", "anomaly.warmup_steps=20", "fault=loss_spike", "fault.at_step=80", "run.name=s"]
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = run_dir(cwd, "s")
    back = event_of(folder, "anomaly")
    assert back is not None and back["anomaly"] == "loss_spike" and back["step"] == 80 and back["ranks"] == [1], back
    assert back["value"] > 50 and back["skipped"][2] == 16, back
    # what each rank trained, step by step, in order: a step trained again after the rollback replaces
    # the first pass's; the spike's step (its first pass) trained exactly the samples skipped, and the
    # epoch as it stands holds every other sample once
    first: Dict[int, List[int]] = {}
    final: Dict[Any, List[int]] = {}
    seen80: set = set()
    for r in (0, 1):
        rows = [json.loads(line) for path in (cwd / "samples").glob(f"rank{r}-*.jsonl") for line in path.read_text().splitlines()]
        for row in rows:
            if row["epoch"] == 1:
                first.setdefault(row["step"], []).extend(row["ids"]) if row["step"] == 80 and r not in seen80 else None
                final[(row["step"], r)] = row["ids"]
            if row["step"] == 80:
                seen80.add(r)
    skipped = set(back["samples"])
    assert skipped == set(first[80]), (sorted(skipped), sorted(first[80]))
    trained = [i for ids in final.values() for i in ids]
    assert len(trained) == len(set(trained)) == 960 - 16 and not skipped & set(trained)
    assert summary(folder)["status"] == "completed" and summary(folder)["skipped_samples"] == 16


@pytest.mark.extended
def test_an_own_dataloader_goes_back_at_the_epochs_end_and_skips_the_same_samples(tmp_path: Path) -> None:
    """A loop's own DataLoader over run.sampler cannot be moved back mid-epoch: the run goes back at the
    epoch's end, and the epoch comes round again without the samples of the NaN's step."""
    cwd = tmp_path / "project"
    shutil.copytree(LOOP, cwd)
    overrides = ["loader=sampler", "check_every=1", "fault=nan_loss", "fault.at_step=20", "run.name=s"]  # found at once
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = run_dir(cwd, "s")
    back = event_of(folder, "anomaly")
    assert back is not None and back["step"] == 20 and back["agreed_at"] == 60 and back["skipped"][2] == 16, (
        back
    )  # 60 steps an epoch
    assert summary(folder)["status"] == "completed" and summary(folder)["global_step"] == 3 * 60 - 1


@pytest.mark.extended
def test_rollbacks_past_the_limit_stop_the_run_with_the_evidence_and_a_healthy_checkpoint(tmp_path: Path) -> None:
    base = [*QUICK, "run.name=r", "fault=nan_loss", "fault.at_step=20", "fault.times=0", "anomaly.max_rollbacks=1"]
    proc = run_train(tmp_path, *base, "anomaly.skip=window", "restart.max_restarts=0")
    folder = run_dir(tmp_path, "r")
    assert proc.returncode == 1, proc.stderr[-3000:]
    found = [e for e in events(folder) if e["event"] == "anomaly"]
    assert len(found) == 2 and all(e["action"] == "rolled_back" for e in found), found
    # skip=window: every batch from the state restored (the epoch's first checkpoint, snapshots off) to the NaN's step
    assert all(e["step"] == 20 and e["skipped"][4] == 20 - e["restored_step"] for e in found), found
    s = summary(folder)
    assert s["status"] == "anomaly_stop" and "anomaly.max_rollbacks=1" in s["error"] and s["stop_saved"] is True, s
    assert s["stop_step"] == found[-1]["restored_step"] and not nonfinite_in_checkpoints(folder)
    assert event_of(folder, "anomaly_stop") is not None and "2 rollbacks" in proc.stderr
