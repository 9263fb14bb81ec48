"""Sweep-level pieces of the launcher (cheap: no torch): what counts as a sweep, the sweep
ledger, packing jobs onto the machine, and the end-of-sweep table.

Generic: nothing here knows the training pipeline. An app names its folders through
`hydra.sweep.dir`/`hydra.sweep.subdir`; the launcher resolves `hydra.sweep.dir` once, from the
sweep's own config, and gives that folder to every job (a sweep has one folder, as in Hydra).
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from steadfast.contract.files import atomic_write

LEDGER_FILE = "sweep_ledger.json"
SWEEP_LOCK_FILE = ".steadfast_sweep.lock"
LEDGER_VERSION = 1

# Job states in the ledger and in the table.
PENDING = "pending"  # part of the sweep, not started yet
RUNNING = "running"  # started; stays so in the ledger if the launcher itself was killed
COMPLETED = "completed"
SKIPPED = "skipped"  # table only: completed by an earlier run of the sweep, result reused
FAILED = "failed"  # failed after its restart budget
INTERRUPTED = "interrupted"  # stopped by a signal (or by fail_fast); resumes from its checkpoints
NOT_RUN = "not run"  # table only: never started because the sweep stopped first


def job_key(overrides: Sequence[str]) -> str:
    """A job's identity in the ledger: its overrides, order-independent."""
    return " ".join(sorted(str(o) for o in overrides)) or "(defaults)"


def config_digest(task_cfg: Any) -> str:
    """sha256 of a job's config as composed (unresolved, without the hydra node)."""
    from omegaconf import OmegaConf

    node = OmegaConf.masked_copy(task_cfg, [k for k in task_cfg.keys() if k != "hydra"])
    return hashlib.sha256(OmegaConf.to_yaml(node).encode()).hexdigest()


def encode_result(value: Any) -> Dict[str, Any]:
    """A job's return value for the ledger: JSON when it can be, else pickled (base64) plus its repr."""
    try:
        json.dumps(value)
        return {"result": value}
    except (TypeError, ValueError):
        pass
    try:
        import cloudpickle

        return {"result": repr(value)[:200], "result_pickle": base64.b64encode(cloudpickle.dumps(value)).decode()}
    except Exception:
        return {"result": repr(value)[:200], "result_unavailable": True}


def decode_result(record: Dict[str, Any]) -> Tuple[bool, Any]:
    """(available, value) of a ledger record's result."""
    if record.get("result_unavailable"):
        return False, None
    if "result_pickle" in record:
        import cloudpickle

        try:
            return True, cloudpickle.loads(base64.b64decode(record["result_pickle"]))
        except Exception:
            return False, None
    return "result" in record, record.get("result")


class Ledger:
    """`sweep_ledger.json` in the sweep folder: one record per job (keyed by its overrides).

    Written only by the launcher's main process, atomically after every change, so a launcher
    killed at any moment leaves a ledger that reads. A record says: overrides, run folder,
    status, attempts (launches over all runs of the sweep), restarts, result, error, times.
    """

    def __init__(self, sweep_dir: Path, header: Dict[str, Any]) -> None:
        self.path = sweep_dir / LEDGER_FILE
        self.data: Dict[str, Any] = {"version": LEDGER_VERSION, **header, "jobs": {}}
        try:
            old = json.loads(self.path.read_text())
            if isinstance(old, dict) and isinstance(old.get("jobs"), dict):
                self.data["jobs"] = old["jobs"]
                self.data["created"] = old.get("created", self.data.get("created"))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:  # unreadable: keep it aside, start a new one
            aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            import logging

            logging.getLogger(__name__).warning("Sweep ledger %s was unreadable (%s); moved to %s", self.path, exc, aside)
        self.data.setdefault("created", round(time.time(), 3))

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


_sweep_locks: Dict[str, int] = {}


def lock_sweep(sweep_dir: Path) -> Optional[str]:
    """One launcher per sweep folder; held until this process ends. Returns who holds it, if not us."""
    key = str(sweep_dir.resolve())
    if key in _sweep_locks:
        return None
    fd = os.open(sweep_dir / SWEEP_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 512).decode(errors="replace").strip() or "another launcher"
        os.close(fd)
        return owner
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _sweep_locks[key] = fd
    return None


# ---------------------------------------------------------------- packing jobs onto the machine


@dataclass
class Machine:
    """What parallel jobs are packed into: `units` are GPU ids, CPU ids, or abstract slots."""

    kind: str  # "gpu", "cpu" or "slots"
    units: List[int]
    labels: List[str] = field(default_factory=list)  # gpu: the ids to put in CUDA_VISIBLE_DEVICES
    free: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(self.units)

    @property
    def capacity(self) -> int:
        return len(self.units)

    def fits(self, procs: int, running: int) -> bool:
        """A job needing more than the whole machine runs alone."""
        if procs > self.capacity:
            return running == 0
        return procs <= len(self.free)

    def take(self, procs: int) -> List[int]:
        n = min(procs, len(self.free))
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, units: List[int]) -> None:
        self.free = sorted(set(self.free) | set(units))


def visible_gpus() -> List[str]:
    """GPU ids this process may use, without importing torch: CUDA_VISIBLE_DEVICES, else the driver's list."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for part in (p.strip() for p in env.split(",")):
            if not part or part.startswith("-"):  # CUDA stops at the first invalid id
                break
            ids.append(part)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def machine(max_procs: Optional[int]) -> Machine:
    if max_procs is not None:
        return Machine("slots", list(range(max_procs)))
    gpus = visible_gpus()
    if gpus:
        return Machine("gpu", list(range(len(gpus))), labels=gpus)
    cpus = sorted(os.sched_getaffinity(0))
    return Machine("cpu", cpus, labels=[str(c) for c in cpus])


def pick(pending: Sequence[Tuple[int, int]], machine: Machine, running: int, max_parallel: int,
         busy: Iterable[Any] = (), folders: Optional[Dict[int, Any]] = None) -> Optional[int]:
    """The first pending job (idx, procs) that fits now, or None: first-fit, in sweep order.

    Jobs whose run folder is in use by a running job wait (identical trials of a sweeper).
    """
    if running >= max_parallel:
        return None
    busy = set(busy)
    for idx, procs in pending:
        if folders is not None and folders.get(idx) in busy:
            continue
        if machine.fits(procs, running):
            return idx
    return None


# ---------------------------------------------------------------- the table


def describe_result(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, (int, float)):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def format_table(rows: List[Dict[str, Any]]) -> str:
    """Rows with keys job, overrides, status, restarts, result, folder."""
    head = ("job", "overrides", "status", "restarts", "result", "run folder")
    keys = ("job", "overrides", "status", "restarts", "result", "folder")
    body = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 60)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths)):
            if len(cell) > w:
                cell = cell[: w - 3] + "..."
            out.append(cell.rjust(w) if i in (0, 3) else cell.ljust(w))
        return "  ".join(out).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])
