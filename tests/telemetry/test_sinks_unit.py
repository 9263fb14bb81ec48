"""logger.sinks in one process: metrics.csv (one row per step, a header that grows, a cell written
once across attempts, a damaged file set aside), the Sink interface (a failing sink is left out),
the pre-flight's checks, mlflow_run.json (validated, no credentials), and the MLflow sink against a
real local tracking store (sqlite, in a temp folder; skipped without the mlflow package)."""

from __future__ import annotations

import csv
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

import pytest

from steadfast.config import LoggerConf, MlflowConf, SinkKind, settings_from
from steadfast.telemetry import mlflow_run, sinks
from steadfast.telemetry._csv import CsvSink
from steadfast.telemetry._sink import Sink, Sinks, scalars
from steadfast.telemetry.mlflow_run import SavedRun


def read_csv(folder: Path) -> List[Dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def window(step: int, loss: float, restart: int = 0, **more: Any) -> Dict[str, Any]:
    return {
        "time": 1000.0 + step,
        "step": step,
        "epoch": 0,
        "loss": loss,
        "restart": restart,
        "rss_mb_per_rank": [1.0, 2.0],
        **more,
    }


# ---- metrics.csv ------------------------------------------------------------------------------------
def test_csv_one_row_per_step_a_growing_header_and_a_cell_written_once_across_attempts(tmp_path: Path) -> None:
    first = CsvSink(tmp_path)
    first.write(window(10, 1.5))
    first.write(window(20, 1.25))
    first.write({"time": 1021.0, "step": 20, "epoch": 0, "val_loss": 1.1, "note": "text", "done": True})  # the epoch's row
    first.write(window(30, 1.0))  # logged, then lost to a kill: the resume is from step 20
    first.close()
    assert list(read_csv(tmp_path)[0]) == ["step", "time", "epoch", "loss", "restart", "val_loss"]  # widened, no text/bool/list
    # the next attempt: step 30 trained again (its values are not written again), an epoch row lost
    # before (val_loss at 30) filled in, then new steps; a new metric widens the header once more
    again = CsvSink(tmp_path)
    again.write(window(30, 0.9, restart=1))
    again.write({"time": 1031.0, "step": 30, "val_loss": 0.8})
    again.write(window(40, 0.7, restart=1, lr=0.01))
    again.write(window(50, 0.6, restart=1, lr=0.01))
    again.close()
    rows = read_csv(tmp_path)
    assert [r["step"] for r in rows] == ["10", "20", "30", "40", "50"]
    assert [(r["loss"], r["val_loss"], r["restart"], r["lr"]) for r in rows] == [
        ("1.5", "", "0", ""),
        ("1.25", "1.1", "0", ""),
        ("1.0", "0.8", "0", ""),  # the first values of step 30; its missing cell filled
        ("0.7", "", "1", "0.01"),
        ("0.6", "", "1", "0.01"),
    ]
    assert rows[1]["time"] == "1020.0"  # the step's first row's


def test_csv_a_line_cut_by_a_crash_is_dropped_and_the_file_continued(tmp_path: Path) -> None:
    sink = CsvSink(tmp_path)
    sink.write(window(10, 1.5))
    sink.close()
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("20,1020.0,0,1.2")  # no newline: the write a kill cut short
    sink = CsvSink(tmp_path)
    sink.write(window(20, 1.25))
    sink.close()
    assert [(r["step"], r["loss"]) for r in read_csv(tmp_path)] == [("10", "1.5"), ("20", "1.25")]


@pytest.mark.parametrize(
    "text",
    [
        "loss,step\n1,2\n",  # not our header
        "step,time,loss\n10,1.0,x\n",  # not a number
        "step,time,loss\n10,1.0,1\n10,2.0,2\n",  # a step twice
        "step,time,loss,loss\n10,1.0,1,1\n",  # a column twice
        "step,time\n-3,1.0\n",  # not a step
        b"step,time\n\xff\n",  # not UTF-8
    ],
)
def test_csv_an_unusable_file_is_set_aside_and_a_new_one_begun(
    tmp_path: Path, text: Any, caplog: pytest.LogCaptureFixture
) -> None:
    data = text if isinstance(text, bytes) else text.encode()
    (tmp_path / "metrics.csv").write_bytes(data)
    (tmp_path / "metrics.csv.unusable").write_text("an earlier one")
    sink = CsvSink(tmp_path)
    sink.write(window(10, 1.5))
    sink.close()
    assert (tmp_path / "metrics.csv.unusable-1").read_bytes() == data  # kept, not lost
    assert (tmp_path / "metrics.csv.unusable").read_text() == "an earlier one"
    assert [r["step"] for r in read_csv(tmp_path)] == ["10"]
    assert "metrics.csv" in caplog.text and "set aside as metrics.csv.unusable-1" in caplog.text


def test_csv_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.csv"
    target.write_text("step,time\n")
    (tmp_path / "metrics.csv").symlink_to(target)
    CsvSink(tmp_path).write(window(10, 1.5))
    assert target.read_text() == "step,time\n" and (tmp_path / "metrics.csv.unusable").is_symlink()


# ---- the interface ------------------------------------------------------------------------------------
class Broken(Sink):
    name = "broken"

    def __init__(self) -> None:
        self.rows = 0

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows += 1
        raise OSError("disk full")


class Kept(Sink):
    name = "kept"

    def __init__(self) -> None:
        self.rows: List[Mapping[str, Any]] = []
        self.result: Optional[Mapping[str, Any]] = None

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows.append(row)

    def completed(self, result: Mapping[str, Any], model: Optional[Path]) -> None:
        self.result = result


def test_a_failing_sink_is_left_out_with_one_warning_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    broken, kept = Broken(), Kept()
    group = Sinks([broken, kept])
    for step in (10, 20, 30):
        group.write(window(step, 1.0))
    group.completed({"status": "completed"}, None)
    group.close()
    assert broken.rows == 1 and len(kept.rows) == 3 and kept.result == {"status": "completed"}
    assert caplog.text.count("logger.sinks: broken failed (OSError: disk full)") == 1


def test_scalars_are_the_numbers_of_a_row_but_its_place() -> None:
    assert scalars(window(10, 1.5, note="x", ok=True)) == {"epoch": 0, "loss": 1.5, "restart": 0}


def test_sinks_open_on_rank_0_only_and_each_once(tmp_path: Path) -> None:
    conf = LoggerConf(sinks=[SinkKind.csv, SinkKind.csv])
    assert not sinks.open_sinks(conf, tmp_path, {}, 1, 0, 2)
    assert [s.name for s in sinks.open_sinks(conf, tmp_path, {}, 0, 0, 2).sinks] == ["csv"]


# ---- the pre-flight's checks and the schema -----------------------------------------------------------------------
def test_a_sink_that_is_not_one_is_refused_naming_what_is() -> None:
    with pytest.raises(ValueError, match=r"Invalid value 'wandb', expected one of \[tensorboard, csv, mlflow\]"):
        settings_from({"logger": {"sinks": ["wandb"]}})


def test_credentials_in_the_configured_uri_are_refused_and_not_shown() -> None:
    conf = LoggerConf(sinks=[SinkKind.mlflow], mlflow=MlflowConf(tracking_uri="https://bob:hunter2@mlflow.example:5000/x"))
    (problem,) = [p for p in sinks.problems(conf) if "tracking_uri" in p]
    assert problem.startswith("logger.mlflow.tracking_uri='https://mlflow.example:5000/x (with credentials, not shown)'")
    assert "hunter2" not in problem and "bob" not in problem and "MLFLOW_TRACKING_PASSWORD" in problem
    assert sinks.problems(LoggerConf(sinks=[SinkKind.csv], mlflow=conf.mlflow)) == []  # only when mlflow is a sink


def test_a_sink_whose_package_is_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sinks, "find_spec", lambda name: None)
    found = sinks.problems(LoggerConf(sinks=[SinkKind.tensorboard, SinkKind.mlflow, SinkKind.csv]))
    assert [p.split(":")[0] for p in found] == ["logger.sinks has tensorboard", "logger.sinks has mlflow"]
    assert "pip install 'steadfast[mlflow]'" in found[1]


@pytest.mark.parametrize(
    "uri,shown,secret",
    [
        ("https://bob:hunter2@host:5000/path?token=abc#x", "https://host:5000/path", True),
        ("http://host:5000", "http://host:5000", False),
        ("sqlite:////tmp/store.db", "sqlite:////tmp/store.db", False),
        ("postgresql://u:pw@db/mlflow", "postgresql://db/mlflow", True),
        ("http://host/x?api_key=1", "http://host/x", True),
        ("databricks", "databricks", False),
    ],
)
def test_the_tracking_uri_recorded_has_no_credentials(uri: str, shown: str, secret: bool) -> None:
    assert mlflow_run.redacted(uri) == shown and mlflow_run.credentials_in(uri) is secret


def test_an_error_message_is_scrubbed_of_the_uris_secrets() -> None:
    uri = "https://bob:hunter2@host:5000/x?token=abc"
    text = f"API request to {uri}/api/2.0/runs failed; auth bob:hunter2; query token=abc"
    assert mlflow_run.scrub(text, uri) == "API request to https://host:5000/x/api/2.0/runs failed; auth ***; query ***"


def test_the_run_file_is_validated_on_read(tmp_path: Path) -> None:
    assert mlflow_run.read(tmp_path) == (None, None)
    saved = SavedRun("0123456789abcdef0123456789abcdef", "f00d", "http://u:p@host:5000")
    mlflow_run.write(tmp_path, saved)
    assert "u:p" not in (tmp_path / "mlflow_run.json").read_text()
    assert mlflow_run.read(tmp_path) == (SavedRun(saved.key, "f00d", "http://host:5000"), None)
    for text, why in (
        ('{"key": "../x", "run_id": null, "tracking_uri": "x"}', "key"),
        ('{"key": "0123456789abcdef0123456789abcdef", "run_id": "a/../b", "tracking_uri": "x"}', "run_id"),
        ('{"key": "0123456789abcdef0123456789abcdef", "run_id": null}', "tracking_uri"),
        ("[1]", "JSON object"),
        ("x" * 5000, "JSON object"),
    ):
        (tmp_path / "mlflow_run.json").write_text(text)
        found, problem = mlflow_run.read(tmp_path)
        assert found is None and problem is not None and why in problem, (text, problem)


# ---- the MLflow sink against a real local store -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, str]]:
    """One sqlite tracking store for the module (creating its tables takes seconds), its artifacts in a temp folder."""
    pytest.importorskip("mlflow", reason="the mlflow package is not installed: pip install -e '.[mlflow]'")
    pytest.importorskip("sqlalchemy", reason="a local MLflow store needs sqlalchemy: pip install -e '.[mlflow]'")
    from mlflow import MlflowClient

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/store.db"
    saved = {k: os.environ.get(k) for k in ("MLFLOW_DISABLE_TELEMETRY", "MLFLOW_TRACKING_URI")}
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    MlflowClient(uri).create_experiment("unit", artifact_location=str(folder / "artifacts"))
    yield {"uri": uri, "experiment": "unit"}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def mlflow_sink(store: Dict[str, str], run_dir: Path, restart: int = 0, **conf: Any) -> Any:
    from steadfast.telemetry._mlflow import MlflowSink

    settings = MlflowConf(tracking_uri=store["uri"], experiment=store["experiment"], **conf)
    return MlflowSink(settings, run_dir, {"trainer": {"lr": 0.1, "layers": [4, 8]}, "run": {"name": run_dir.name}}, restart, 2)


def history(client: Any, run_id: str, key: str) -> List[tuple]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_the_mlflow_sink_continues_one_run_across_attempts_and_sends_each_step_once(
    store: Dict[str, str], tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(store["uri"])
    first = mlflow_sink(store, tmp_path)
    for step in (10, 20, 30):
        first.write(window(step, 1.0 / step))
    first.close()  # a stop: the run is continued by the next attempt
    saved, _ = mlflow_run.read(tmp_path)
    assert saved is not None and saved.run_id is not None and client.get_run(saved.run_id).info.status == "KILLED"
    again = mlflow_sink(store, tmp_path, restart=1)
    again.write(window(30, 5.0, restart=1))  # trained again after the resume: not sent again
    again.write(window(40, 0.025, restart=1))
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"weights")
    again.completed({"status": "completed", "global_step": 40, "final_loss": 0.02, "model_sha256": "ab" * 32}, model)
    again.close()
    run = client.get_run(saved.run_id)
    assert mlflow_run.read(tmp_path)[0] == saved
    assert len(client.search_runs([run.info.experiment_id], filter_string=f"tags.`steadfast.run_name` = '{tmp_path.name}'")) == 1
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert history(client, saved.run_id, "loss") == [(10, 0.1), (20, 0.05), (30, 1.0 / 30), (40, 0.025)]
    assert history(client, saved.run_id, "restart") == [(10, 0), (20, 0), (30, 0), (40, 1)]
    assert history(client, saved.run_id, "summary/final_loss") == [(40, 0.02)]
    assert run.data.params == {"trainer.lr": "0.1", "trainer.layers": "[4, 8]", "run.name": tmp_path.name}
    assert run.data.tags["steadfast.restart"] == "1" and run.data.tags["summary.status"] == "completed"
    assert [(f.path, f.file_size) for f in client.list_artifacts(saved.run_id)] == [("model.safetensors", 7)]
    # the same command once more on the completed run: nothing sent twice, the same weights not uploaded again
    last = mlflow_sink(store, tmp_path, restart=0)
    last.completed({"status": "completed", "global_step": 40, "final_loss": 0.5, "model_sha256": "ab" * 32}, model)
    model.unlink()  # an upload would fail now
    last.close()
    assert history(client, saved.run_id, "summary/final_loss") == [(40, 0.02)]
    assert client.get_run(saved.run_id).info.status == "FINISHED"


def test_an_attempt_stopped_between_recording_the_key_and_the_run_finds_the_run_by_its_tag(
    store: Dict[str, str], tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(store["uri"])
    experiment = client.get_experiment_by_name(store["experiment"]).experiment_id
    key = "feedfacefeedfacefeedfacefeedface"
    mlflow_run.write(tmp_path, SavedRun(key, None, store["uri"]))
    made = client.create_run(experiment, run_name="made", tags={mlflow_run.RUN_KEY_TAG: key})
    sink = mlflow_sink(store, tmp_path)
    sink.write(window(10, 1.0))
    sink.close()
    assert mlflow_run.read(tmp_path)[0] == SavedRun(key, made.info.run_id, store["uri"])
    assert history(client, made.info.run_id, "loss") == [(10, 1.0)]


def test_an_unreachable_server_costs_one_warning_and_no_wait(
    store: Dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    caplog.set_level(logging.WARNING, "steadfast")
    sink = mlflow_sink({"uri": f"http://bob:hunter2@127.0.0.1:{port}", "experiment": "x"}, tmp_path, timeout_s=60)
    started = time.monotonic()
    for step in range(10, 1000, 10):
        sink.write(window(step, 1.0))
    sink.close()
    assert time.monotonic() - started < 30  # not the 60 s timeout: the thread ended at its first error
    warnings = [r.getMessage() for r in caplog.records if "mlflow" in r.getMessage()]
    assert len(warnings) == 1 and f"mlflow (http://127.0.0.1:{port}) failed" in warnings[0], warnings
    assert "hunter2" not in caplog.text
    assert not any("hunter2" in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())


def test_the_library_and_the_pre_flight_import_no_sink_package() -> None:
    """mlflow, sqlalchemy and tensorboard are imported by their sink, when it opens on rank 0."""
    code = (
        "import sys, steadfast, steadfast.run, steadfast.preflight, steadfast.telemetry.sinks\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'sqlalchemy', 'tensorboard'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
