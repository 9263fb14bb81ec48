"""The checkpoint protocol under real failures (../shared/notes/failures.md, scenarios 1-9, 14, 15).

Every recovery must end with the same model_sha256 as the uninterrupted baseline run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from helpers import (
    QUICK,
    assert_metrics_csv_matches,
    committed_steps,
    event_of,
    events,
    run_dir,
    run_train,
    start_train,
    stop,
    summary,
    wait_for,
)
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint import tensorfile

pytestmark = pytest.mark.slow
STEPS = ["checkpoint=every_n_steps", "checkpoint.every_n_steps=6"]  # 16 batches an epoch: mid-epoch saves


def finished_copy(baseline: dict, tmp_path: Path, name: str = "copy") -> Path:
    """A copy of the finished baseline run, to damage and resume."""
    folder = run_dir(tmp_path, name)
    shutil.copytree(baseline["dir"], folder)
    for junk in ("summary.json", ".steadfast.lock", "events.jsonl", "metrics.jsonl"):  # a fresh record
        (folder / junk).unlink(missing_ok=True)
    return folder


def newest(folder: Path) -> Path:
    return folder / "checkpoints" / f"step_{committed_steps(folder)[-1]:09d}"


def assert_same_weights(folder: Path, baseline: dict) -> None:
    s = summary(folder)
    assert s["status"] == "completed" and s["epochs_completed"] == 4
    assert s["model_sha256"] == baseline["summary"]["model_sha256"]
    leftovers = [p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert not leftovers


def test_crash_in_the_middle_of_writing_a_checkpoint(tmp_path: Path, baseline: dict) -> None:
    # torchrun only: the commit protocol is the same code on every backend; a Horovod worker killed
    # mid-step is test_kill_right_after_a_save_and_again_in_the_first_step_after_resume[horovod]
    # logger=csv, and the control plane's message every step: step 20's metrics row is written before the
    # crash at 24, and again after the resume from 18 (metrics.csv must hold it once)
    csv = ["logger=csv", "trainer.stop_check_every_n_steps=1"]
    run_train(tmp_path, *QUICK, *STEPS, "run.name=r", "fault=crash_in_save", "fault.at_step=20", *csv, check=True)
    folder = run_dir(tmp_path, "r")
    fired = event_of(folder, "fault_fired")
    resumed = event_of(folder, "resumed")
    assert fired["step"] == 24 and resumed["step"] == 18  # the partial step 24 was invisible to resume
    assert not event_of(folder, "checkpoint_invalid")
    assert_same_weights(folder, baseline)
    logged = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert logged.count(20) == 2  # trained and logged again after the resume
    assert_metrics_csv_matches(folder)  # once in metrics.csv (tests/telemetry/test_sinks_unit.py: the cases)


@pytest.mark.extended
def test_kill_right_after_a_save_and_again_in_the_first_step_after_resume(
    tmp_path: Path, baseline: dict, backend: list[str]
) -> None:
    base = [*QUICK, *backend, *STEPS, "run.name=r", "restart=none"]
    assert run_train(tmp_path, *base, "fault=kill_rank", "fault.at_step=25").returncode != 0
    folder = run_dir(tmp_path, "r")
    assert committed_steps(folder)[-1] == 24
    assert run_train(tmp_path, *base, "fault=kill_rank", "fault.rank=1", "fault.at_step=25").returncode != 0
    assert [e["step"] for e in events(folder) if e["event"] == "resumed"] == [24]
    run_train(tmp_path, *base, check=True)
    assert_same_weights(folder, baseline)


@pytest.mark.extended
def test_disk_full_during_save_is_loud_and_keeps_the_previous_checkpoint(tmp_path: Path, baseline: dict) -> None:
    # torchrun only: a save's outcome is agreed through Comm, and every save of the Horovod tests
    # goes through that agreement on Horovod's side
    proc = run_train(
        tmp_path, *QUICK, *STEPS, "run.name=r", "fault=save_error", "fault.at_step=20", "fault.times=0", "restart.max_restarts=3"
    )
    folder = run_dir(tmp_path, "r")
    assert proc.returncode != 0
    assert "No space left on device" in proc.stderr and "step_000000018" in proc.stderr  # names the intact one
    # it would fail the same way on every attempt: stopped at the first failure, not restarted
    failed = [e for e in events(folder) if e["event"] == "attempt_failed"]
    assert len(failed) == 1 and failed[0]["rank"] == 0, failed
    assert failed[0]["not_restarted"].startswith("the disk is full (a checkpoint save found no space left) (rank 0 at step")
    assert "\nThe disk is full" in proc.stderr
    assert committed_steps(folder)[-1] == 18
    assert summary(folder)["status"] == "failed" and summary(folder)["restarts"] == 0
    assert not [p for p in (folder / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    # once the disk has room again, the same command finishes the run exactly
    run_train(tmp_path, *QUICK, *STEPS, "run.name=r", check=True)
    assert_same_weights(folder, baseline)


def test_unwritable_checkpoint_folder_is_refused_before_workers_start(tmp_path: Path) -> None:
    proc = run_train(tmp_path, *QUICK, "run.name=r", "checkpoint.dir=/proc/steadfast-checkpoints", timeout=60)
    assert proc.returncode != 0
    assert "checkpoint folder /proc/steadfast-checkpoints is not writable" in proc.stderr.splitlines()[0]
    assert not event_of(run_dir(tmp_path, "r"), "attempt_started")


def _truncate(ckpt: Path) -> None:
    data = (ckpt / "state.bin").read_bytes()
    (ckpt / "state.bin").write_bytes(data[: len(data) // 2])


def _flip(ckpt: Path) -> None:
    data = bytearray((ckpt / "state.bin").read_bytes())
    data[len(data) - 8] ^= 0x01
    (ckpt / "state.bin").write_bytes(bytes(data))


def _drop_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    (ckpt / "junk.partial").write_bytes(b"left by a crash")


@pytest.mark.parametrize(
    "damage,logged",
    [
        (_flip, "state.bin"),
        pytest.param(_truncate, "state.bin", marks=pytest.mark.extended),
        pytest.param(_drop_manifest, None, marks=pytest.mark.extended),
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, baseline: dict, damage, logged) -> None:
    folder = finished_copy(baseline, tmp_path)
    broken = newest(folder)
    previous = committed_steps(folder)[-2]
    damage(broken)
    run_train(tmp_path, *QUICK, "run.name=copy", check=True)
    assert event_of(folder, "resumed")["step"] == previous
    if logged:
        invalid = event_of(folder, "checkpoint_invalid")
        assert invalid and logged in invalid["error"]
    assert sorted(p.name for p in broken.iterdir()) == ["manifest.json", "state.bin"]
    assert_same_weights(folder, baseline)


def test_tampered_checkpoint_runs_no_code_and_is_refused(tmp_path: Path, baseline: dict, backend: list[str]) -> None:
    folder = finished_copy(baseline, tmp_path)
    ckpt = newest(folder)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps({"state": Payload()})
    (ckpt / "state.bin").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # the attacker fixes the checksums too
    import xxhash

    manifest["files"]["state.bin"] = {"bytes": len(payload), "checksum": f"xxh3_128:{xxhash.xxh3_128(payload).hexdigest()}"}
    (ckpt / "manifest.json").write_bytes(mf.seal(manifest))  # and the manifest's digest
    run_train(tmp_path, *QUICK, *backend, "run.name=copy", check=True)
    assert not marker.exists()
    assert "not a steadfast tensor file" in event_of(folder, "checkpoint_invalid")["error"]
    assert_same_weights(folder, baseline)


def test_incompatible_config_is_refused_and_safe_change_accepted(tmp_path: Path, baseline: dict) -> None:
    folder = finished_copy(baseline, tmp_path)
    proc = run_train(tmp_path, *QUICK, "run.name=copy", "trainer.lr=0.5", "model.hidden_sizes=[8]", timeout=60)
    assert proc.returncode != 0
    first = proc.stderr.splitlines()[0]
    assert "trainer.lr: 0.05 -> 0.5" in first and "model.hidden_sizes: [64, 64] -> [8]" in first
    assert not event_of(folder, "attempt_started")
    run_train(tmp_path, *QUICK, "run.name=copy", "trainer.max_epochs=5", "trainer.log_every_n_steps=3", check=True)
    change = event_of(folder, "config_changed_on_resume")
    assert change["accepted"] == "safe to change"
    assert ["trainer.max_epochs", 4, 5] in change["changes"]
    assert summary(folder)["epochs_completed"] == 5


@pytest.mark.extended
def test_a_verified_checkpoint_missing_a_key_is_unusable_and_the_previous_one_is_used(tmp_path: Path, baseline: dict) -> None:
    """Its files verify, but it does not fit the model: it is named (file or folder, and the key), set
    aside, and the run continues from the checkpoint before, ending with the baseline's weights."""
    folder = finished_copy(baseline, tmp_path)
    ckpt = newest(folder)
    tree = tensorfile.load(ckpt / "state.bin")
    tree = {**tree, "objects": {**tree["objects"], "model": dict(tree["objects"]["model"])}}
    del tree["objects"]["model"]["net.1.bias"]
    size, digest = tensorfile.save(tree, ckpt / "state.bin")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state.bin"] = {"bytes": size, "checksum": digest}
    (ckpt / "manifest.json").write_bytes(mf.seal(manifest))
    proc = run_train(tmp_path, *QUICK, "run.name=copy", "restart=none", check=True)
    invalid = event_of(folder, "checkpoint_invalid")
    assert invalid["path"] == str(ckpt) and "net.1.bias" in invalid["error"], invalid
    assert "net.1.bias" in proc.stderr and str(ckpt) in proc.stderr
    assert event_of(folder, "checkpoint_set_aside")["path"] == str(ckpt)
    assert event_of(folder, "resumed")["step"] < manifest["step"]
    assert_same_weights(folder, baseline)


@pytest.mark.extended
def test_second_launch_on_a_busy_folder_refuses_and_a_dead_lock_holder_does_not_block(tmp_path: Path, baseline: dict) -> None:
    first = start_train(tmp_path, *QUICK, "run.name=r", "fault=hang_rank", "fault.at_step=5")
    folder = run_dir(tmp_path, "r")
    try:
        wait_for(lambda: event_of(folder, "fault_fired"), 120, "the first launch to be running", first)
        second = run_train(tmp_path, *QUICK, "run.name=r", timeout=60)
        assert second.returncode != 0
        assert f"in use by pid {first.pid}" in second.stderr
    finally:
        stop(first)  # SIGKILL: the lock holder dies without releasing anything
    run_train(tmp_path, *QUICK, "run.name=r", check=True)
    assert_same_weights(folder, baseline)


def test_async_saves_survive_a_kill_and_end_exactly(tmp_path: Path, baseline: dict, backend: list[str]) -> None:
    run_train(
        tmp_path,
        *QUICK,
        *backend,
        *STEPS,
        "checkpoint.async_save=true",
        "run.name=r",
        "fault=kill_rank",
        "fault.at_step=31",
        check=True,
    )
    folder = run_dir(tmp_path, "r")
    assert event_of(folder, "checkpoint_snapshot") is not None
    assert event_of(folder, "resumed")["step"] in (24, 30)  # step 30 may still have been writing
    assert_same_weights(folder, baseline)


@pytest.mark.extended
def test_async_save_failure_stops_the_run_loudly(tmp_path: Path) -> None:
    proc = run_train(
        tmp_path,
        *QUICK,
        *STEPS,
        "checkpoint.async_save=true",
        "run.name=r",
        "restart=none",
        "fault=save_error",
        "fault.at_step=20",
    )
    assert proc.returncode != 0
    assert "No space left on device" in proc.stderr
    assert committed_steps(run_dir(tmp_path, "r"))[-1] == 18


@pytest.mark.extended
def test_corrupt_checkpoint_fault_is_detected_on_resume(tmp_path: Path, baseline: dict) -> None:
    # the final checkpoint (step 52) is damaged right after it is committed; running the command
    # again must notice, fall back to step 48 and redo the last steps exactly
    args = [*QUICK, *STEPS, "run.name=r", "fault=corrupt_checkpoint", "fault.at_step=52"]
    run_train(tmp_path, *args, check=True)
    folder = run_dir(tmp_path, "r")
    assert event_of(folder, "fault_fired")["step"] == 52
    run_train(tmp_path, *args, check=True)
    assert event_of(folder, "checkpoint_invalid")["step"] == 52
    assert event_of(folder, "resumed")["step"] == 48
    assert_same_weights(folder, baseline)
