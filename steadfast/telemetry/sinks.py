"""Where rank 0's metrics rows go besides metrics.jsonl: `logger.sinks`, any of tensorboard, csv, mlflow;
opened here (open_sinks), checked by the pre-flight here (problems).

A sink is one small class behind `Sink` (_sink.py): `write(row)` for every row of metrics.jsonl (the same dict,
`time` and `step` included), `completed(result, model)` once when the run completes (summary.json's
fields, the final weights' file), `close()` at the end of every attempt. A sink never stops
training: the first error a sink raises is logged once, and that sink is left out for the rest of
the attempt (metrics.jsonl has every row). Third-party packages are imported by the sink that needs
them, when it is opened on rank 0: `import steadfast` and the training loop import none of them.

csv and mlflow write a (metric, step) once, the first time it is logged: a step trained again
after a resume (logged again, with its `restart`, in metrics.jsonl) is not written again, so their
table or chart has one value per step (docs/failures.md#metrics-elsewhere-csv-mlflow-tensorboard).
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from pathlib import Path
from typing import Any, List, Mapping

from ..config import LoggerConf, SinkKind
from ..contract.schemas import bad
from ._sink import Sink, Sinks
from .mlflow_run import credentials_in, redacted, tracking_uri

log = logging.getLogger("steadfast")

DATABASE_STORES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow stores that need sqlalchemy and alembic


def problems(conf: LoggerConf) -> List[str]:
    """What in logger.sinks and logger.mlflow would not work (the pre-flight's, before any worker starts)."""
    out: List[str] = []
    for kind, package in ((SinkKind.tensorboard, "tensorboard"), (SinkKind.mlflow, "mlflow")):
        if kind in conf.sinks and find_spec(package) is None:
            out.append(
                f"logger.sinks has {kind.value}: the {package} package is not installed. Install it with "
                f"`pip install 'steadfast[{kind.value}]'` (from a checkout: pip install -e '.[{kind.value}]'), or leave it out of logger.sinks"
            )
    if SinkKind.mlflow not in conf.sinks:
        return out
    given = conf.mlflow.tracking_uri
    if given and credentials_in(given):
        out.append(
            bad(
                "logger.mlflow.tracking_uri",
                redacted(given) + " (with credentials, not shown)",
                "a URI without a user, password or token (config.yaml records it): give them in MLflow's "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN",
            )
        )
    uri = tracking_uri(conf.mlflow) or ""
    if uri.partition(":")[0].partition("+")[0] in DATABASE_STORES and find_spec("sqlalchemy") is None:
        out.append(
            f"logger.sinks has mlflow with the database store {redacted(uri)} (logger.mlflow.tracking_uri, else "
            "MLFLOW_TRACKING_URI): it needs sqlalchemy and alembic: `pip install 'steadfast[mlflow]'`"
        )
    if conf.mlflow.timeout_s < 0:
        out.append(
            bad("logger.mlflow.timeout_s", conf.mlflow.timeout_s, "seconds >= 0 (the most an attempt's end waits for MLflow)")
        )
    return out


def open_sinks(conf: LoggerConf, run_dir: Path, config: Mapping[str, Any], rank: int, restart: int, world_size: int) -> Sinks:
    """The sinks `conf.sinks` names, opened on rank 0 (other ranks get none). One that cannot open
    is logged and left out, as a sink that fails later is."""
    if rank != 0:
        return Sinks()
    opened: List[Sink] = []
    for kind in dict.fromkeys(conf.sinks):  # each once, in the order given
        try:
            opened.append(_open(kind, conf, run_dir, config, restart, world_size))
        except Exception as exc:  # noqa: BLE001 - a sink must never stop training
            log.warning(
                "logger.sinks: %s could not open (%s: %s); metrics.jsonl has every row", kind.value, type(exc).__name__, exc
            )
    return Sinks(opened)


def _open(kind: SinkKind, conf: LoggerConf, run_dir: Path, config: Mapping[str, Any], restart: int, world_size: int) -> Sink:
    if kind is SinkKind.tensorboard:
        from ._tensorboard import TensorBoardSink

        return TensorBoardSink(run_dir / "tensorboard")
    if kind is SinkKind.csv:
        from ._csv import CsvSink

        return CsvSink(run_dir)
    from ._mlflow import MlflowSink

    return MlflowSink(conf.mlflow, run_dir, config, restart, world_size)
