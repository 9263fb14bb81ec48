"""Preemption with real signals (failures.md scenario 4): SIGTERM/SIGINT to the launcher or to a
worker; every rank stops at the same step boundary, saves, and the launcher exits with
EXIT_PREEMPTED (75) after SIGTERM; the same command then continues with no step lost and ends
with the weights of an uninterrupted run.

The moment of the signal is placed with faults that hold a rank in a given place until it is
asked to stop (`fault.hang_until_stop=true`): in the backward pass, at a step boundary, in the
middle of writing a checkpoint. The tests wait for the fault's event, never for a time.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Tuple

import pytest

from helpers import QUICK, committed_steps, event_of, events, run_dir, run_train, start_train, stop, summary, wait_for
from steadfast.contract.exits import exit_code

pytestmark = pytest.mark.slow
STEPS = ["checkpoint=every_n_steps", "checkpoint.every_n_steps=6"]  # 13 batches an epoch: mid-epoch saves
EVERY_STEP = ["trainer.stop_check_every_n_steps=1"]  # the agreement at every step: the tests place the stop exactly
PREEMPTED = 75
BATCHES_PER_EPOCH = 13  # QUICK: 410 training samples, 2 workers, batches of 16


def launch_and_signal(tmp_path: Path, overrides: list, sig: int, to: str = "launcher", wait_for_event: str = "fault_fired"):
    """Start the job, wait for `wait_for_event`, send `sig` to the launcher or to the rank that fired; (exit code, output)."""
    proc = start_train(tmp_path, *overrides)
    folder = run_dir(tmp_path, "r")
    try:
        fired = wait_for(lambda: event_of(folder, wait_for_event), 180, wait_for_event, proc)
        os.kill(proc.pid if to == "launcher" else fired["pid"], sig)
        code = proc.wait(timeout=120)
    finally:
        out = stop(proc)
    return code, out


def assert_stopped_and_saved(folder: Path, step: int) -> None:
    stopped = event_of(folder, "preempted")
    assert stopped is not None and stopped["saved"] and stopped["step"] == step, stopped
    assert committed_steps(folder)[-1] == step  # zero steps lost
    s = summary(folder)
    assert s["status"] == "preempted" and s["stop_step"] == step and s["stop_saved"]
    assert not [e for e in events(folder) if e["event"] in ("worker_failed", "relaunch")]
    assert not event_of(folder, "attempt_started", restart=1), "a stop is not a failure: nothing restarts"


def assert_resumes_exactly(tmp_path: Path, folder: Path, baseline: dict, overrides: list, step: int) -> None:
    run_train(tmp_path, *overrides, check=True)  # the same command again
    assert [e["step"] for e in events(folder) if e["event"] == "resumed"][-1] == step
    s = summary(folder)
    assert s["status"] == "completed" and s["model_sha256"] == baseline["summary"]["model_sha256"]


def stop_step(folder: Path, out: str, allowed: Tuple[int, ...]) -> int:
    """The step every rank stopped at, one of `allowed`, and the launcher's message names it."""
    stopped = event_of(folder, "preempted")
    assert stopped is not None and stopped["step"] in allowed, (stopped, out[-3000:])
    said = [line for line in out.splitlines() if "preempted by" in line]
    assert f"stopped at step {stopped['step']}, checkpoint committed: no step lost" in "".join(said), said
    return int(stopped["step"])


def test_sigterm_to_the_launcher_during_backward(tmp_path: Path, baseline: dict, backend: list) -> None:
    # rank 1 is held inside the backward pass of step 20 (rank 0 waits in the gradient all-reduce);
    # the launcher forwards SIGTERM; step 20 completes, the ranks agree (the agreement is pipelined:
    # the flags of step 20 are read at step 21), and both stop at step 21. A loaded machine can
    # leave rank 0 short of its boundary of step 19 when the signal comes (rank 1 only needed its
    # gradients): then the flags of step 19 carry it and both stop at step 20, as promised too.
    args = [
        *QUICK,
        *EVERY_STEP,
        *backend,
        "run.name=r",
        "fault=hang_in_backward",
        "fault.rank=1",
        "fault.at_step=20",
        "fault.hang_until_stop=true",
    ]
    code, out = launch_and_signal(tmp_path, args, signal.SIGTERM)
    folder = run_dir(tmp_path, "r")
    assert code == PREEMPTED, out[-3000:]
    step = stop_step(folder, out, (20, 21))
    assert_stopped_and_saved(folder, step)
    assert_resumes_exactly(tmp_path, folder, baseline, args, step)


@pytest.mark.extended
def test_sigterm_to_one_worker_at_a_random_step(tmp_path: Path, baseline: dict) -> None:
    # a scheduler that signals one process: the other rank learns it from the agreement, which by
    # default runs about every 50 ms (every few steps here) and at every epoch's end
    seed = int(os.environ.get("STEADFAST_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    step, rank = rng.randint(2, 3 * BATCHES_PER_EPOCH - 1), rng.randint(0, 1)  # an epoch's end still comes after it
    print(f"seed {seed}: SIGTERM to rank {rank} after step {step}")
    args = [*QUICK, "run.name=r", "fault=hang_rank", f"fault.rank={rank}", f"fault.at_step={step}", "fault.hang_until_stop=true"]
    code, out = launch_and_signal(tmp_path, args, signal.SIGTERM, to="worker")
    folder = run_dir(tmp_path, "r")
    assert code == PREEMPTED, (seed, out[-3000:])
    stopped = event_of(folder, "preempted")
    assert stopped is not None and step <= stopped["step"] <= -(-(step + 1) // BATCHES_PER_EPOCH) * BATCHES_PER_EPOCH, (
        seed,
        stopped,
    )
    assert_stopped_and_saved(folder, stopped["step"])
    assert_resumes_exactly(tmp_path, folder, baseline, args, stopped["step"])


@pytest.mark.extended
def test_sigint_to_the_launcher_during_a_checkpoint_write(tmp_path: Path, baseline: dict) -> None:
    # rank 0 is held after the first file of the checkpoint of step 24: the write completes, then
    # every rank stops at the next step boundary but one (25 reports the request, 26 acts on it;
    # the save is collective, so rank 1 has reported at its boundary of step 24 before rank 0 writes)
    args = [*QUICK, *EVERY_STEP, *STEPS, "run.name=r", "fault=hang_in_save", "fault.at_step=20", "fault.hang_until_stop=true"]
    code, out = launch_and_signal(tmp_path, args, signal.SIGINT)
    folder = run_dir(tmp_path, "r")
    assert code == exit_code(signal.SIGINT), out[-3000:]  # 130 after Ctrl-C (75 after SIGTERM)
    assert 24 in committed_steps(folder)
    stop_step(folder, out, (26,))
    assert_stopped_and_saved(folder, 26)
    assert event_of(folder, "preempted")["signal"] == "SIGINT"
    assert_resumes_exactly(tmp_path, folder, baseline, args, 26)


@pytest.mark.extended
@pytest.mark.parametrize("rerun", [True, False], ids=["torchrun+rerun", "horovod"])
def test_a_save_that_cannot_finish_in_the_grace_leaves_the_previous_checkpoint(
    tmp_path: Path, baseline: dict, rerun: bool
) -> None:
    # rank 0 hangs in the middle of writing step 24 and does not react to the request: after
    # restart.preemption_grace_s the workers are stopped; step 18 stays the newest committed one
    if not rerun:
        pytest.importorskip("horovod.torch")
    backend = [] if rerun else ["backend=horovod"]
    args = [
        *QUICK,
        *STEPS,
        *backend,
        "run.name=r",
        "fault=hang_in_save",
        "fault.at_step=20",
        "fault.hang_s=120",
        "restart.preemption_grace_s=2",
    ]
    code, out = launch_and_signal(tmp_path, args, signal.SIGTERM)
    folder = run_dir(tmp_path, "r")
    assert code == PREEMPTED, out[-3000:]
    assert "stopped before the workers could save (restart.preemption_grace_s=2)" in out
    assert event_of(folder, "preemption_grace_expired") is not None
    assert event_of(folder, "preempted") is None
    assert committed_steps(folder)[-1] == 18
    assert [p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith(".tmp-step_000000024")]
    s = summary(folder)
    assert s["status"] == "preempted" and s["stop_saved"] is False
    if rerun:
        run_train(tmp_path, *args, check=True)
        assert [e["step"] for e in events(folder) if e["event"] == "resumed"] == [18]
        assert summary(folder)["model_sha256"] == baseline["summary"]["model_sha256"]
        assert not [p for p in (folder / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_sigterm_before_any_worker_registered_ends_the_launch_at_once(tmp_path: Path) -> None:
    # no worker can register (the agent waits in its rendezvous for a second node that never
    # comes): there is nothing to save, so the launcher abandons the launch instead of waiting
    args = [*QUICK, "run.name=r", "backend.nnodes=2", "backend.nproc_per_node=1", "backend.rdzv_endpoint=localhost:0"]
    proc = start_train(tmp_path, *args)
    folder = run_dir(tmp_path, "r")
    try:
        wait_for(lambda: event_of(folder, "launch"), 120, "the launch", proc)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=20)
    finally:
        out = stop(proc)
    assert code == PREEMPTED, out[-3000:]
    assert "stopped during start-up, before the first step: nothing to save" in out and "(exit code 75)" in out
    assert event_of(folder, "job_interrupted")["signal"] == "SIGTERM"
    assert summary(folder)["status"] == "preempted" and not committed_steps(folder)


@pytest.mark.extended
def test_fault_sigterm_through_verify_recovery(tmp_path: Path) -> None:
    import subprocess
    import sys

    from helpers import env

    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.verify_recovery", *QUICK, *EVERY_STEP, "fault=sigterm", "fault.at_step=20"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "faulted: launch 1 stopped on request (exit code 75)" in proc.stdout
    assert "fault fired: sigterm on rank 0 at step 20" in proc.stdout and "resumed from step(s) 21" in proc.stdout
    assert "RESULT: MATCH" in proc.stdout
    faulted = next((tmp_path / "outputs" / "verify_recovery").glob("*/faulted"))
    assert [e["fault"] for e in events(faulted) if e["event"] == "fault_fired"] == ["sigterm"]  # fired once over two launches
