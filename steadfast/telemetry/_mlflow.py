"""logger.sinks has mlflow: the run logged to MLflow, from rank 0, by a thread of its own.

Training never waits for MLflow: rows go into a queue, and one thread imports mlflow, finds or
creates the run, and sends them in batches. The run folder keeps one MLflow run for all its
attempts (mlflow_run.py): a restart, a relaunch or the same command again continues it, setting
it RUNNING again; the end of an attempt sets it FINISHED (completed) or KILLED (stopped, failed;
a resume continues it). The first run of a folder gets the resolved config as params (flattened
with dots, within MLflow's limits); a later attempt adds the params that are new (a changed value
stays as first logged: MLflow's params do not change). Tags: the run's name and folder, the restart
count and world size of the attempt, and at the end summary.json's text fields (`summary.*`);
its numbers become metrics `summary/*` at the last step, and model.safetensors an artifact.

A (metric, step) is sent once: a resumed attempt reads each metric's last step from the MLflow
run and sends only later steps. The first error (unreachable server, refused request) is logged
once with the tracking URI cut of credentials, and MLflow gets nothing more this attempt;
metrics.jsonl has every row. The end of an attempt waits for what is queued: at most
logger.mlflow.timeout_s after the run completed (the model's upload), 2 s after a stop, not at all
after a failure.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import queue
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import MlflowConf
from . import mlflow_run
from ._sink import Sink, scalars, step_of
from .mlflow_run import RUN_KEY_TAG, SavedRun

log = logging.getLogger("steadfast")

# MLflow's limits (mlflow/utils/validation.py)
MAX_NAME = 250
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 5000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
STOPPED_WAIT_S = 2.0  # the most an attempt that stopped (preempted, memory limit) waits for MLflow at its end
_NOT_IN_NAME = re.compile(r"[^\w.\- /]")  # what MLflow refuses in a param or metric name (":" too, as on Windows)


def mlflow_name(key: str) -> Optional[str]:
    """`key` as an MLflow param or metric name: refused characters become "_"; None if it is too
    long or reads as another path ("a//b", "../x")."""
    name = _NOT_IN_NAME.sub("_", key)
    if not name or len(name) > MAX_NAME or posixpath.normpath(name) != name or name.startswith(("/", "..")):
        return None
    return name


def params(config: Mapping[str, Any]) -> Dict[str, str]:
    """The config flattened to MLflow params: `group.key` -> the value as text (a list as JSON), cut to MLflow's limit."""
    out: Dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        name = mlflow_name(prefix)
        if name is not None:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:MAX_PARAM_VALUE]

    walk("", config)
    return out


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, conf: MlflowConf, run_dir: Path, config: Mapping[str, Any], restart: int, world_size: int) -> None:
        self.conf, self.run_dir, self.config = conf, run_dir, config
        self.restart, self.world_size = restart, world_size
        self.uri = mlflow_run.tracking_uri(conf) or ""  # "" until the thread asks MLflow for its default
        self.shown = mlflow_run.redacted(self.uri)
        self.run_id: Optional[str] = None
        self._top: Dict[str, int] = {}  # each metric's last step sent
        self._names: Dict[str, Optional[str]] = {}
        self._tags: Dict[str, str] = {}  # the run's tags when this attempt attached to it
        self._completing = self._completed = False  # completed() called; its part sent
        self._queue: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        self._failed = threading.Event()
        self._thread = threading.Thread(target=self._work, name="steadfast-mlflow", daemon=True)
        self._thread.start()

    # ---- the training thread's side: never waits ------------------------------------------------
    def write(self, row: Mapping[str, Any]) -> None:
        if not self._failed.is_set():
            self._queue.put(("row", row))

    def completed(self, result: Mapping[str, Any], model: Optional[Path]) -> None:
        self._completing = True
        if not self._failed.is_set():
            self._queue.put(("completed", (dict(result), model)))

    def close(self) -> None:
        """Waits for what is queued: after the run completed, up to logger.mlflow.timeout_s (the
        model's upload); after a stop, up to STOPPED_WAIT_S; while an error unwinds, not at all (the
        restart is not held up)."""
        self._queue.put(("close", None))
        if sys.exc_info()[0] is not None:
            return
        wait = self.conf.timeout_s if self._completing else min(self.conf.timeout_s, STOPPED_WAIT_S)
        self._thread.join(min(wait, threading.TIMEOUT_MAX))
        if self._thread.is_alive():
            log.warning(
                "logger.sinks: mlflow (%s) had not sent everything after %g s: left (metrics.jsonl has every row%s)",
                self.shown,
                wait,
                "; logger.mlflow.timeout_s sets the wait" if self._completing else "",
            )

    # ---- the sink's thread -------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            client = self._attach()
            while True:
                items = [self._queue.get()]
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                rows = [payload for kind, payload in items if kind == "row"]
                self._send(client, rows)
                for kind, payload in items:
                    if kind == "completed":
                        self._finish(client, *payload)
                if any(kind == "close" for kind, _ in items):
                    client.set_terminated(self.run_id, "FINISHED" if self._completed else "KILLED")
                    return
        except Exception as exc:  # noqa: BLE001 - MLflow must never stop training
            self._failed.set()
            text = mlflow_run.scrub((str(exc).splitlines() or [""])[0], self.uri)
            log.warning(
                "logger.sinks: mlflow (%s) failed: %s: %.300s; MLflow gets nothing more this attempt (a restart tries "
                "again), metrics.jsonl has every row",
                self.shown or "MLflow's default tracking URI",
                type(exc).__name__,
                text,
            )

    def _attach(self) -> Any:
        """The client, and this run folder's MLflow run: found again, or created."""
        import mlflow
        from mlflow import MlflowClient

        if not self.uri:
            self.uri = mlflow.get_tracking_uri()
            self.shown = mlflow_run.redacted(self.uri)
        client = MlflowClient(tracking_uri=self.uri)
        saved, problem = mlflow_run.read(self.run_dir)
        if problem:
            log.warning("logger.sinks: mlflow: %s; a new MLflow run is created", problem)
        if saved is not None and saved.tracking_uri != self.shown:
            log.warning(
                "logger.sinks: mlflow: this run folder's MLflow run is on %s, the tracking URI is now %s: a new MLflow run there",
                saved.tracking_uri,
                self.shown,
            )
            saved = None
        run = self._find(client, saved)
        if run is None:
            saved = SavedRun(uuid.uuid4().hex, None, self.shown)
            mlflow_run.write(self.run_dir, saved)  # before the run: found by its tag if stopped in between
            run = client.create_run(
                self._experiment(client),
                run_name=self.run_dir.name,
                tags={RUN_KEY_TAG: saved.key, "steadfast.run_name": self.run_dir.name},
            )
            log.info("MLflow: run %s on %s", run.info.run_id, self.shown)
        else:
            self._top = {m.key: int(m.step) for m in getattr(run.data, "_metric_objs", [])}
            self._tags = dict(run.data.tags)
            client.update_run(run.info.run_id, status="RUNNING")
            log.info(
                "MLflow: continuing run %s on %s (metrics up to step %s sent)",
                run.info.run_id,
                self.shown,
                max(self._top.values(), default="-"),
            )
        self.run_id = run.info.run_id
        if saved is not None and saved.run_id != self.run_id:
            mlflow_run.write(self.run_dir, SavedRun(saved.key, self.run_id, self.shown))
        self._params(client, run.data.params)
        self._send_tags(
            client,
            {
                "steadfast.run_dir": str(self.run_dir),
                "steadfast.restart": str(self.restart),
                "steadfast.world_size": str(self.world_size),
            },
        )
        return client

    def _find(self, client: Any, saved: Optional[SavedRun]) -> Any:
        """The run `saved` names (by its id, else by its key's tag); None when there is none to continue."""
        from mlflow.exceptions import MlflowException

        if saved is None:
            return None
        if saved.run_id is None:
            found = client.search_runs(
                [self._experiment(client)], filter_string=f"tags.`{RUN_KEY_TAG}` = '{saved.key}'", max_results=1
            )
            return found[0] if found else None
        try:
            run = client.get_run(saved.run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        why = (
            "does not exist"
            if run is None
            else "is deleted"
            if run.info.lifecycle_stage == "deleted"
            else "is another run's"
            if run.data.tags.get(RUN_KEY_TAG) != saved.key
            else None
        )
        if why is None:
            return run
        log.warning(
            "logger.sinks: mlflow: the run folder's MLflow run %s %s on %s: a new one is created", saved.run_id, why, self.shown
        )
        return None

    def _experiment(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        name = self.conf.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        for _ in range(2):
            found = client.get_experiment_by_name(name)
            if found is not None:
                if found.lifecycle_stage == "deleted":
                    raise RuntimeError(
                        f"the MLflow experiment {name!r} is deleted: restore it, or choose logger.mlflow.experiment"
                    )
                return str(found.experiment_id)
            try:
                return str(client.create_experiment(name))
            except MlflowException:  # created meanwhile by another run: found on the second pass
                continue
        raise RuntimeError(f"the MLflow experiment {name!r} can be neither found nor created")

    def _params(self, client: Any, logged: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params(self.config).items() if k not in logged]
        for i in range(0, len(new), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=new[i : i + PARAMS_PER_BATCH], synchronous=True)

    def _send_tags(self, client: Any, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        client.log_batch(self.run_id, tags=[RunTag(k, v[:MAX_TAG_VALUE]) for k, v in tags.items()], synchronous=True)

    def _name(self, key: str) -> Optional[str]:
        if key not in self._names:
            self._names[key] = mlflow_name(key)
        return self._names[key]

    def _send(self, client: Any, rows: List[Mapping[str, Any]], prefix: str = "") -> None:
        """Each row's numbers as metrics at its step, those of a step already sent left out."""
        from mlflow.entities import Metric

        metrics: List[Any] = []
        for row in rows:
            step = step_of(row)
            if step is None:
                continue
            stamp = int(1000 * (row.get("time") or time.time()))
            for key, value in scalars(row).items():
                name = self._name(prefix + key)
                if name is None or step <= self._top.get(name, -1):
                    continue
                self._top[name] = step
                metrics.append(Metric(name, float(value), stamp, step))
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH], synchronous=True)

    def _finish(self, client: Any, result: Dict[str, Any], model: Optional[Path]) -> None:
        """summary.json's fields (numbers as metrics summary/* at the last step, text as tags summary.*)
        and the final weights as an artifact (once: not again for the same weights)."""
        step = result.get("global_step")
        self._send(client, [{**result, "step": step if isinstance(step, int) else 0, "time": time.time()}], "summary/")
        sha = result.get("model_sha256")
        if model is not None and self.conf.log_model and model.is_file():
            have = {f.path: f.file_size for f in client.list_artifacts(self.run_id)}
            if not (sha and self._tags.get("summary.model_sha256") == sha and have.get(model.name) == model.stat().st_size):
                client.log_artifact(self.run_id, str(model))
        text = {f"summary.{k}": str(v) for k, v in result.items() if isinstance(v, (str, bool))}
        self._send_tags(client, text)
        self._completed = True
