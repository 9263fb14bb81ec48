"""Distributed multirun sweeps end to end: every job a real multi-process job (torch elastic).

Small on purpose (synthetic data, a few epochs): each job takes a few seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from helpers import QUICK, events, run_train, start_train, stop, summary, wait_for

pytestmark = pytest.mark.slow

SHORT = [*QUICK, "trainer.max_epochs=2"]


def sweep_folder(cwd: Path) -> Path:
    found = [p for p in (cwd / "outputs" / "sweeps").iterdir() if p.is_dir()]
    assert len(found) == 1, found
    return found[0]


def ledger(sweep: Path) -> Dict[str, Dict[str, Any]]:
    data = json.loads((sweep / "sweep_ledger.json").read_text())
    return data["jobs"]


def by_override(jobs: Dict[str, Dict[str, Any]], needle: str) -> Dict[str, Any]:
    (rec,) = [r for r in jobs.values() if needle in r["overrides"]]
    return rec


def table_rows(output: str) -> List[str]:
    lines = output.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("job  overrides"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip() or not line.strip()[0].isdigit():
            break
        rows.append(line)
    return rows


def test_2x2_sweep_gives_every_job_its_own_folder_rendezvous_and_result(tmp_path: Path) -> None:
    proc = run_train(tmp_path, "-m", *SHORT, "trainer.lr=0.05,0.1", "trainer.seed=0,1", check=True)
    sweep = sweep_folder(tmp_path)
    assert "trainer.lr=0.05-0.1" in sweep.name and "trainer.seed=0-1" in sweep.name  # named after the sweep
    jobs = ledger(sweep)
    assert len(jobs) == 4 and {r["status"] for r in jobs.values()} == {"completed"}
    assert {r["attempts"] for r in jobs.values()} == {1}
    folders = {r["run_dir"] for r in jobs.values()}
    assert len(folders) == 4, folders
    endpoints, run_ids, shas = set(), set(), set()
    for rec in jobs.values():
        folder = sweep / rec["run_dir"]
        s = summary(folder)
        assert s["status"] == "completed" and s["world_size"] == 2 and s["epochs_completed"] == 2
        assert rec["result"] == pytest.approx(s["val_loss"])  # the task's return value, recorded
        (rdzv,) = [e for e in events(folder) if e["event"] == "rendezvous"]
        endpoints.add(rdzv["endpoint"])
        run_ids.add(rdzv["run_id"])
        shas.add(s["model_sha256"])
        assert rdzv["run_id"] == re.sub(r"[^A-Za-z0-9_.-]", "_", folder.name)  # torch elastic's run id: the folder
    assert len(endpoints) == 4 and len(run_ids) == 4 and len(shas) == 4
    assert len(table_rows(proc.stdout + proc.stderr)) == 4
    # The same command again: nothing is launched, every result comes from the ledger.
    again = run_train(tmp_path, "-m", *SHORT, "trainer.lr=0.05,0.1", "trainer.seed=0,1", check=True)
    rows = table_rows(again.stdout + again.stderr)
    assert len(rows) == 4 and all(" skipped " in r for r in rows), rows
    assert {r["attempts"] for r in ledger(sweep).values()} == {1}


@pytest.mark.extended
def test_two_jobs_run_at_once(tmp_path: Path) -> None:
    proc = run_train(
        tmp_path, "-m", *SHORT, "backend.nproc_per_node=1", "trainer.seed=0,1", "hydra.launcher.max_parallel_jobs=2", check=True
    )
    out = proc.stdout + proc.stderr
    sweep = sweep_folder(tmp_path)
    spans = []
    for rec in ledger(sweep).values():
        assert rec["status"] == "completed"
        evs = events(sweep / rec["run_dir"])
        spans.append((evs[0]["time"], evs[-1]["time"]))
        assert evs[0]["event"] == "launch" and evs[-1]["event"] == "job_completed"
    (a0, a1), (b0, b1) = spans
    assert max(a0, b0) < min(a1, b1), f"the jobs did not overlap: {spans}"
    assert "[job #0]" in out and "[job #1]" in out  # each job's output, prefixed
    cpus = [
        line.rsplit(" on CPU ", 1)[1].strip() for line in out.splitlines() if "Launching job #" in line and " on CPU " in line
    ]
    assert len(cpus) == 2 and cpus[0] != cpus[1], cpus  # packed onto different cores


FAILING = [*SHORT, "backend.nproc_per_node=1", "restart=none", "fault=exception,none", "fault.times=0", "fault.at_step=3"]


def test_a_failing_job_does_not_stop_the_sweep(tmp_path: Path) -> None:
    proc = run_train(tmp_path, "-m", *FAILING)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    rows = table_rows(out)
    assert len(rows) == 2
    assert "fault=exception" in rows[0] and " failed " in rows[0]
    assert "fault=none" in rows[1] and " completed " in rows[1]
    assert "InjectedFault" in out and "1 of 2 job(s) failed" in out
    jobs = ledger(sweep_folder(tmp_path))
    assert by_override(jobs, "fault=exception")["status"] == "failed"
    assert "InjectedFault" in by_override(jobs, "fault=exception")["error"]
    done = by_override(jobs, "fault=none")
    assert done["status"] == "completed" and summary(sweep_folder(tmp_path) / done["run_dir"])["status"] == "completed"


@pytest.mark.extended
def test_fail_fast_stops_at_the_first_failure_and_a_rerun_retries_it(tmp_path: Path) -> None:
    proc = run_train(tmp_path, "-m", *FAILING, "hydra.launcher.fail_fast=true")
    assert proc.returncode != 0
    rows = table_rows(proc.stdout + proc.stderr)
    assert " failed " in rows[0] and " not run " in rows[1], rows
    sweep = sweep_folder(tmp_path)
    jobs = ledger(sweep)
    assert by_override(jobs, "fault=none")["status"] == "pending"
    assert not (sweep / by_override(jobs, "fault=none")["run_dir"] / "events.jsonl").exists(), "it was never launched"
    # The same sweep without fail_fast (a Hydra override: same sweep folder): the failed job is
    # tried again, the one that never ran runs now.
    again = run_train(tmp_path, "-m", *FAILING)
    assert again.returncode != 0
    jobs = ledger(sweep)
    assert by_override(jobs, "fault=exception")["attempts"] == 2
    assert by_override(jobs, "fault=none")["status"] == "completed"


@pytest.mark.extended
def test_sigterm_to_the_launcher_then_rerun_resumes_the_sweep(tmp_path: Path, baseline: dict) -> None:
    """Job #0 completes; job #1 holds at step 30 (after its first checkpoints) until it is asked to
    stop, and there the launcher gets SIGTERM. The same command again skips job #0 and resumes job #1; both end with
    the weights of an uninterrupted run of the same training config (the baseline)."""
    args = ["-m", *QUICK, "fault=none,hang_rank", "fault.rank=1", "fault.at_step=30", "fault.hang_until_stop=true"]
    proc = start_train(tmp_path, *args)
    try:
        sweeps = tmp_path / "outputs" / "sweeps"

        def paused() -> Any:
            return [p for p in sweeps.glob("*/*") if p.is_dir() and any(e["event"] == "fault_fired" for e in events(p))]

        (job1,) = wait_for(paused, 180, "job #1 to reach step 30", proc)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as a scheduler would
        code = proc.wait(timeout=120)
    finally:
        out = stop(proc)
    assert code == 75, out  # EXIT_PREEMPTED: run again to continue
    sweep = sweep_folder(tmp_path)
    jobs = ledger(sweep)
    first, second = by_override(jobs, "fault=none"), by_override(jobs, "fault=hang_rank")
    assert first["status"] == "completed" and second["status"] == "interrupted", jobs
    assert (sweep / second["run_dir"]) == job1
    rows = table_rows(out)
    assert " completed " in rows[0] and " interrupted " in rows[1], rows
    events_before = len(events(sweep / first["run_dir"]))

    again = run_train(tmp_path, *args, check=True)
    rows = table_rows(again.stdout + again.stderr)
    assert " skipped " in rows[0] and " completed " in rows[1], rows
    jobs = ledger(sweep)
    assert by_override(jobs, "fault=none")["attempts"] == 1 and by_override(jobs, "fault=hang_rank")["attempts"] == 2
    assert len(events(sweep / first["run_dir"])) == events_before, "a completed job is not launched again"
    resumed = [e for e in events(job1) if e["event"] == "resumed"]
    assert resumed, "the interrupted job resumes from its checkpoint"
    for rec in jobs.values():
        assert summary(sweep / rec["run_dir"])["model_sha256"] == baseline["summary"]["model_sha256"]


@pytest.mark.extended
def test_sigterm_to_a_parallel_sweep_stops_every_running_job(tmp_path: Path) -> None:
    """Two jobs at once, each held at step 40 until it is asked to stop: SIGTERM to the launcher reaches
    both (each runs in its own launcher process), both are recorded interrupted, exit code 75."""
    args = [
        "-m",
        *QUICK,
        "backend.nproc_per_node=1",
        "trainer.seed=0,1",
        "fault=hang_rank",
        "fault.rank=0",
        "fault.at_step=40",
        "fault.hang_until_stop=true",
        "hydra.launcher.max_parallel_jobs=2",
    ]
    proc = start_train(tmp_path, *args)
    try:

        def both_paused() -> Any:
            found = [
                p
                for p in (tmp_path / "outputs" / "sweeps").glob("*/*")
                if p.is_dir() and any(e["event"] == "fault_fired" for e in events(p))
            ]
            return found if len(found) == 2 else None

        wait_for(both_paused, 180, "both jobs to reach step 40", proc)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        out = stop(proc)
    assert code == 75, out
    jobs = ledger(sweep_folder(tmp_path))
    assert [r["status"] for r in jobs.values()] == ["interrupted", "interrupted"], jobs
    rows = table_rows(out)
    assert len(rows) == 2 and all(" interrupted " in r for r in rows), rows


@pytest.mark.extended
def test_optuna_sweeper_optimises_the_returned_objective(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e .[optuna]")
    args = [
        "-m",
        *SHORT,
        "backend.nproc_per_node=1",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=3",
        "hydra.sweeper.sampler.seed=1",
        "trainer.lr=interval(0.01,0.3)",
        "hydra.launcher.max_parallel_jobs=2",
        "trainer.objective=val_loss",
    ]
    run_train(tmp_path, *args, check=True)
    sweep = sweep_folder(tmp_path)
    assert sweep.name.startswith("optuna,")
    jobs = ledger(sweep)
    assert len(jobs) == 3 and {r["status"] for r in jobs.values()} == {"completed"}
    results = {float(r["result"]) for r in jobs.values()}
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(results))
    for rec in jobs.values():  # each trial's value is its job's final val_loss
        assert rec["result"] == pytest.approx(summary(sweep / rec["run_dir"])["val_loss"])
    # The same search again: the sampler proposes the same trials, whose results are recorded.
    again = run_train(tmp_path, *args, check=True)
    rows = table_rows(again.stdout + again.stderr)
    assert len(rows) == 3 and all(" skipped " in r for r in rows), rows
