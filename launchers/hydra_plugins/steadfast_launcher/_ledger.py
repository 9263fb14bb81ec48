"""`sweep_ledger.json` in the sweep folder: one record per job (keyed by its overrides), so running
the same sweep again skips completed jobs, resumes interrupted ones and retries failed ones.

Plain JSON only. A job's result is stored as a JSON value (a number for an objective); a result
that is not one is recorded as unavailable, with its repr, and the job runs again rather than
its result being unpickled. Everything read back is validated field by field: a malformed record
is ignored (the job runs as if new), a malformed file is moved aside; never an exception.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from steadfast.contract.files import atomic_write, read_json_object

log = logging.getLogger(__name__)

LEDGER_FILE = "sweep_ledger.json"
LEDGER_VERSION = 1

# Job states in the ledger and in the table.
PENDING = "pending"  # part of the sweep, not started yet
RUNNING = "running"  # started; stays so in the ledger if the launcher itself was killed
COMPLETED = "completed"
FAILED = "failed"  # failed after its restart budget
INTERRUPTED = "interrupted"  # stopped by a signal (or by fail_fast); resumes from its checkpoints
SKIPPED = "skipped"  # table only: completed by an earlier run of the sweep, result reused
NOT_RUN = "not run"  # table only: never started because the sweep stopped first
RECORDED_STATES = (PENDING, RUNNING, COMPLETED, FAILED, INTERRUPTED)

_MAX_DEPTH = 32


def job_key(overrides: Sequence[str]) -> str:
    """A job's identity in the ledger: its overrides, order-independent."""
    return " ".join(sorted(str(o) for o in overrides)) or "(defaults)"


def config_digest(task_cfg: DictConfig) -> str:
    """sha256 of a job's config as composed (unresolved, without the hydra node)."""
    node = OmegaConf.masked_copy(task_cfg, [str(k) for k in task_cfg.keys() if k != "hydra"])
    return hashlib.sha256(OmegaConf.to_yaml(node).encode()).hexdigest()


class _NotJSON(Exception):
    pass


def json_value(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON (numbers, strings, booleans, null, lists, objects with string keys);
    tuples become lists, numeric scalars (numpy's too) plain numbers. _NotJSON for anything else."""
    if depth > _MAX_DEPTH:
        raise _NotJSON("nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: json_value(v, depth + 1) for k, v in value.items()}
    raise _NotJSON(type(value).__name__)


def encode_result(value: Any) -> Dict[str, Any]:
    """A job's return value for its ledger record."""
    try:
        return {"result": json_value(value), "result_unavailable": False, "result_repr": None}
    except _NotJSON:
        return {"result": None, "result_unavailable": True, "result_repr": repr(value)[:200]}


def decode_result(record: Dict[str, Any]) -> Tuple[bool, Any]:
    """(available, value) of a (validated) ledger record's result. A result an earlier launcher
    stored pickled (`result_pickle`) is unavailable: it is never unpickled, the job runs again."""
    if record.get("result_unavailable") is True or "result_pickle" in record or "result" not in record:
        return False, None
    return True, record["result"]


def _is_json(value: Any) -> bool:
    try:
        json_value(value)
        return True
    except _NotJSON:
        return False


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


# Every field a record may hold, and what it must be; a record with anything else is ignored.
_FIELDS: Dict[str, Callable[[Any], bool]] = {
    "overrides": lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v),
    "run_dir": lambda v: isinstance(v, str),
    "job_num": _count,
    "config_sha256": lambda v: isinstance(v, str),
    "status": lambda v: v in RECORDED_STATES,
    "attempts": _count,
    "restarts": _count,
    "started_at": _optional(_number),
    "ended_at": _optional(_number),
    "wall_seconds": _optional(_number),
    "error": _optional(lambda v: isinstance(v, str)),
    "result": _is_json,
    "result_unavailable": lambda v: isinstance(v, bool),
    "result_repr": _optional(lambda v: isinstance(v, str)),
    "result_pickle": lambda v: isinstance(v, str),  # written by earlier launchers: a marker, never decoded
}


def valid_record(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and record.get("status") in RECORDED_STATES
        and all(key in _FIELDS and _FIELDS[key](value) for key, value in record.items())
    )


class Ledger:
    """The sweep ledger, written only by the launcher's main process, atomically after every change,
    so a launcher killed at any moment leaves a ledger that reads. A record says: overrides, run
    folder, status, attempts (launches over all runs of the sweep), restarts, result, error, times.
    """

    def __init__(self, sweep_dir: Path, header: Dict[str, Any]) -> None:
        self.path = sweep_dir / LEDGER_FILE
        self.data: Dict[str, Any] = {"version": LEDGER_VERSION, **header, "jobs": {}}
        old = read_json_object(self.path)
        if old is None and (self.path.exists() or self.path.is_symlink()):
            self._set_aside("not a readable JSON object")
        elif old is not None:
            jobs = old.get("jobs")
            if not isinstance(jobs, dict):
                self._set_aside("no jobs object")
            else:
                kept = {k: r for k, r in jobs.items() if isinstance(k, str) and valid_record(r)}
                if len(kept) < len(jobs):
                    log.warning(
                        "Sweep ledger %s: ignored %d malformed record(s); those jobs run as if new",
                        self.path,
                        len(jobs) - len(kept),
                    )
                self.data["jobs"] = kept
                if _number(old.get("created")):
                    self.data["created"] = old["created"]
        self.data.setdefault("created", round(time.time(), 3))

    def _set_aside(self, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
        n = 1
        while os.path.lexists(aside):  # an earlier one from the same second stays too
            aside, n = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}-{n}"), n + 1
        try:
            os.replace(self.path, aside)
        except OSError:
            pass
        log.warning("Sweep ledger %s was unusable (%s); moved to %s", self.path, why, aside)

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        return self.data["jobs"].get(key)

    def update(self, key: str, **fields: Any) -> Dict[str, Any]:
        record = self.data["jobs"].setdefault(key, {})
        record.update(fields)
        self.save()
        return record

    def save(self) -> None:
        self.data["updated"] = round(time.time(), 3)
        atomic_write(self.path, json.dumps(self.data, indent=2, default=str) + "\n")
