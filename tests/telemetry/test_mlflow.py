"""logger.sinks has mlflow, end to end: a real 2-worker launch logging to a real local MLflow tracking
store (sqlite, in the test's folder, through MLFLOW_TRACKING_URI), one worker killed with SIGKILL
after the MLflow run has its first rows: the restart continues the same MLflow run, a step trained
again is not sent again, and the completed run has the params, the summary and model.safetensors.
Skipped without the mlflow package (make setup-extended installs it)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from helpers import (
    QUICK,
    assert_metrics_csv_matches,
    event_of,
    first_values,
    run_dir,
    start_train,
    stop,
    summary,
    wait_for,
)
from steadfast.telemetry import mlflow_run

pytestmark = [pytest.mark.slow, pytest.mark.extended]
SECRET = "do-not-record-this-token"


def run_id_of(folder: Path) -> Optional[str]:
    saved, _ = mlflow_run.read(folder)
    return saved.run_id if saved is not None else None


def sent(client: Any, run_id: str, key: str, min_step: int) -> bool:
    return any(m.step >= min_step for m in client.get_metric_history(run_id, key))


def test_a_killed_and_restarted_run_is_one_mlflow_run_with_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="the mlflow package is not installed: make setup-extended (pip install -e '.[mlflow]')")
    pytest.importorskip("sqlalchemy", reason="a local MLflow store needs sqlalchemy: pip install -e '.[mlflow]'")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for name, value in {
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_NAME": "steadfast-test",
        "MLFLOW_TRACKING_TOKEN": SECRET,  # MLflow's own credential variable: never written anywhere by us
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }.items():
        monkeypatch.setenv(name, value)
    client = MlflowClient(uri)  # the store exists before the run, as a team's does
    experiment = client.create_experiment("steadfast-test", artifact_location=str(tmp_path / "artifacts"))
    # rank 1 stops at step 38 (alive, silent) until the MLflow run has step 30's row; then a real SIGKILL.
    # The resume is from step 26 (a checkpoint an epoch of 13 steps); step 30 is trained and logged again.
    proc = start_train(
        tmp_path,
        *QUICK,
        "run.name=r",
        "logger.sinks=[csv,mlflow]",
        "trainer.stop_check_every_n_steps=1",  # a metrics row is written a step after its window
        "fault=hang_rank",
        "fault.rank=1",
        "fault.at_step=38",
    )
    folder = run_dir(tmp_path, "r")
    try:
        hung = wait_for(lambda: event_of(folder, "fault_fired"), 180, "rank 1 to stop at step 38", proc)
        run_id = wait_for(lambda: run_id_of(folder), 120, "the MLflow run's id in mlflow_run.json", proc)
        wait_for(lambda: sent(client, run_id, "loss", 30), 120, "step 30's row in MLflow", proc, every=0.5)
        os.kill(hung["pid"], signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-4000:]
    s = summary(folder)
    assert s["status"] == "completed" and s["restarts"] == 1
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["restart"]) for r in logged if r["step"] == 30 and "loss" in r] == [(30, 0), (30, 1)]

    (run,) = client.search_runs([experiment])  # one MLflow run for the run folder, restarted or not
    assert run.info.run_id == run_id and run.info.run_name == "r" and run.info.status == "FINISHED"
    assert run.data.tags["steadfast.restart"] == "1" and run.data.tags["summary.model_sha256"] == s["model_sha256"]
    # every metric by step, once each, the first value metrics.jsonl has
    first = first_values(folder)
    steps: Dict[str, List[int]] = {}
    for key in {k for _, k in first}:
        points = client.get_metric_history(run_id, key)
        steps[key] = [m.step for m in points]
        assert sorted(steps[key]) == sorted({step for step, k in first if k == key}), key
        assert all(m.value == pytest.approx(first[(m.step, key)]) for m in points), key
    assert 30 in steps["loss"] and 52 in steps["val_loss"]
    assert [m.value for m in client.get_metric_history(run_id, "summary/final_loss")] == [pytest.approx(s["final_loss"])]
    params = run.data.params
    assert params["trainer.max_epochs"] == "4" and params["data.num_samples"] == "512"
    assert params["logger.sinks"] == '["csv", "mlflow"]'
    artifacts = {f.path: f.file_size for f in client.list_artifacts(run_id)}
    assert artifacts == {"model.safetensors": (folder / "model.safetensors").stat().st_size}
    assert_metrics_csv_matches(folder)  # the same launch: metrics.csv, one row per step
    recorded = [p for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not recorded, recorded
