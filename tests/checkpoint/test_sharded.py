"""Sharded training end to end, with real workers: a user's own FSDP2 loop (tests/apps/fsdp_loop,
copied out of the repository and run as `python train.py`) and the built-in trainer with
parallel=fsdp. Killed at random steps, they end with the uninterrupted run's weights; saved on 2
workers, a run continues on 1, 2 and 3 with every sample of every epoch trained once; every rank
writes only its own pieces; a checkpoint consolidates into the model's one file."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List

import pytest

from helpers import QUICK, ROOT, env, events, restores, run_dir, run_train, summary
from steadfast.contract.heartbeat import read_heartbeats

pytestmark = pytest.mark.slow
APP = ROOT / "tests" / "apps" / "fsdp_loop"
SMALL = ["samples=720", "restart.max_restarts=6"]


def project(tmp_path: Path) -> Path:
    cwd = tmp_path / "project"
    shutil.copytree(APP, cwd)
    return cwd


def app(cwd: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def killed(cwd: Path, overrides: List[str], seed: int, kills: int, last_step: int) -> Path:
    """The app run with `kills` SIGKILLs of a random rank, each once that rank's heartbeat shows a
    random step of a new attempt (the kill lands anywhere in the step after it: with accumulation,
    between micro-batches); returns its run folder once it completed."""
    rng = random.Random(seed)
    plan = sorted(rng.sample(range(last_step // 6, last_step * 3 // 4), kills))
    proc = subprocess.Popen(
        [sys.executable, "train.py", *overrides, "run.name=killed"],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    folder = run_dir(cwd, "killed")
    try:
        for attempt, step in enumerate(plan):
            rank, deadline = rng.randrange(2), time.monotonic() + 180
            while True:
                beat = read_heartbeats(folder).get(rank)
                if beat and beat.get("restart") == attempt and beat.get("phase") == "train" and beat.get("step", -1) >= step:
                    os.kill(beat["pid"], signal.SIGKILL)
                    break
                assert proc.poll() is None, f"the run ended before attempt {attempt} reached step {step} (seed {seed})"
                assert time.monotonic() < deadline, f"attempt {attempt} did not reach step {step} (seed {seed})"
                time.sleep(0.005)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (seed, out[-4000:])
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The own loop, natural accumulation over 4 batches, uninterrupted (and its folder)."""
    cwd = project(tmp_path_factory.mktemp("fsdp"))
    app(cwd, *SMALL, "accumulate=4", "run.name=ref")
    return {"cwd": cwd, "folder": run_dir(cwd, "ref"), "summary": summary(run_dir(cwd, "ref"))}


def test_own_fsdp_loop_with_accumulation_killed_at_random_steps_ends_exact(reference: Dict[str, Any]) -> None:
    seed = int(os.environ.get("STEADFAST_TEST_SEED", random.randrange(10**6)))
    last = reference["summary"]["global_step"]
    folder = killed(reference["cwd"], [*SMALL, "accumulate=4"], seed, kills=2, last_step=last)
    got = summary(folder)
    assert got["restarts"] == 2 and got["global_step"] == last, (seed, got)
    assert got["model_sha256"] == reference["summary"]["model_sha256"], seed
    assert all(r["reached"] - r["step"] <= 20 for r in restores(folder)), (seed, restores(folder))


def test_each_rank_writes_only_its_own_pieces(reference: Dict[str, Any]) -> None:
    from safetensors import safe_open

    ckpt = sorted((reference["folder"] / "checkpoints").glob("step_*"))[-1]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == 3 and set(manifest["files"]) == {"rank00000.bin", "rank00001.bin"}
    held: Dict[str, int] = defaultdict(int)
    for key, entry in manifest["tensors"].items():
        files = [piece[0] for piece in entry["pieces"]]
        assert len(files) == len(set(files)), key  # no piece twice
        for file, _, shape in entry["pieces"]:
            with safe_open(str(ckpt / file), "pt") as f:  # each file holds exactly the pieces the table gives it
                assert list(f.get_slice(key).get_shape()) == shape
            held[file] += 1
    sharded = [k for k, e in manifest["tensors"].items() if len(e["pieces"]) == 2]
    assert len(sharded) >= 16  # the weights and both Adam moments of every layer, split over the two ranks
    for file in manifest["files"]:
        with safe_open(str(ckpt / file), "pt") as f:
            assert sum(1 for k in f.keys() if not k.startswith("@rank")) == held[file], file
    # rank 0 stores half of each sharded tensor and the small unsharded ones (Adam's step counts): its file
    # is about half of what one rank would write alone, not the whole state
    sizes = {f: spec["bytes"] for f, spec in manifest["files"].items()}
    assert sizes["rank00000.bin"] < 0.7 * sum(sizes.values()), sizes


def test_a_checkpoint_consolidates_into_the_models_one_file(reference: Dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.checkpoint.consolidate", str(reference["folder"]), "-o", str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    final = load_file(str(reference["folder"] / "model.safetensors"))  # finish() gathered it from the live model
    mine = load_file(str(out))
    assert sorted(mine) == sorted(final) and all((mine[k] == final[k]).all() for k in mine)


def test_saved_on_two_workers_continues_on_one_then_three_with_every_sample_once(tmp_path: Path) -> None:
    """2 -> 1 -> 3 workers (a shrink, then a growth past the saved size), each launch but the last
    stopped by a preemption notice at some step (committed, exit code 75), accumulation declared over
    2 batches. 720 samples in batches of 6: every resume position leaves a multiple of 1, 2 and 3
    samples in the epoch, so no world size drops any (the sampler drops at most world_size - 1 at an
    epoch's end, as DistributedSampler does)."""
    cwd = project(tmp_path)
    base = [*SMALL, "accumulate=2", "declared=true", "run.name=ws"]
    for workers, stop_at in ((2, 13), (1, 50), (3, None)):
        extra = ["fault=sigterm", f"fault.at_step={stop_at}"] if stop_at else []
        proc = app(cwd, *base, f"backend.nproc_per_node={workers}", *extra, check=stop_at is None)
        assert stop_at is None or proc.returncode == 75, proc.stderr[-4000:]
    folder = run_dir(cwd, "ws")
    assert summary(folder)["status"] == "completed" and summary(folder)["epochs_completed"] == 3
    changes = [(e["saved_world_size"], e["world_size"]) for e in events(folder) if e["event"] == "world_size_changed"]
    assert changes == [(2, 1), (1, 3)], changes
    seen: Dict[int, Counter] = defaultdict(Counter)
    for file in (cwd / "samples").iterdir():
        for line in file.read_text().splitlines():
            row = json.loads(line)
            seen[row["epoch"]].update(row["ids"])
    for epoch in range(3):
        assert sorted(seen[epoch]) == list(range(720)), f"epoch {epoch}: samples missing"
        assert set(seen[epoch].values()) == {1}, (
            f"epoch {epoch}: trained twice: {[i for i, n in seen[epoch].items() if n > 1][:10]}"
        )


@pytest.mark.extended
def test_builtin_trainer_with_parallel_fsdp_killed_ends_exact(tmp_path: Path) -> None:
    fsdp = [*QUICK, "parallel=fsdp", "trainer.accumulate_grad_batches=2", "snapshot.every_n_steps=auto"]
    run_train(tmp_path, *fsdp, "run.name=ref", check=True)
    run_train(tmp_path, *fsdp, "run.name=r", "fault=kill_rank", "fault.rank=1", "fault.at_step=21", check=True)
    ref, got = summary(run_dir(tmp_path, "ref")), summary(run_dir(tmp_path, "r"))
    assert got["restarts"] == 1 and got["model_sha256"] == ref["model_sha256"], (ref, got)
    manifest = json.loads(next((run_dir(tmp_path, "r") / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["format"] == 3
