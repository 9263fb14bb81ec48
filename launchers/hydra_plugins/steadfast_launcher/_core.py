"""Per-job work of the launcher: validate, freeze the config, lock the run folder, launch, restart."""
from __future__ import annotations

import fcntl
import functools
import importlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException
from hydra.types import TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from . import contract
from ._schemas import BackendConf, ConfigError, RestartConf, backend_from, restart_from

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
LOCK_FILE = ".steadfast.lock"


class JobFailed(CompactHydraException):
    """A job that failed after its restart budget; the message names the root cause."""


class WorkerFailure(Exception):
    """Raised by a backend adapter when the workers of one launch failed."""

    def __init__(self, message: str, restarts: int = 0) -> None:
        super().__init__(message)
        self.restarts = restarts


@dataclass
class Job:
    idx: int
    overrides: List[str]
    config: DictConfig  # the job's full config (with the hydra node), as Hydra composed it
    backend: BackendConf
    restart: RestartConf

    @property
    def label(self) -> str:
        shown = " ".join(filter_overrides(self.overrides)) or "(defaults)"
        return f"job #{self.idx} [{shown}]"


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    setup_globals()
    config: DictConfig = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    jobs = [_prepare(launcher, list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)]
    _preflight(launcher, jobs)  # every job of the sweep is checked before any worker starts
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    returns: List[JobReturn] = []
    for job in jobs:
        log.info("Launching %s on %s", job.label, _describe(job.backend))
        ret = run_job(
            hydra_context=launcher.hydra_context,
            task_function=functools.partial(_run_job_distributed, job, launcher.task_function),
            config=job.config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        returns.append(ret)
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    return returns


def _prepare(launcher: Any, overrides: List[str], idx: int) -> Job:
    sweep_config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = idx
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)  # lets ${hydra:...} resolve while we check it
    backend = backend_from(OmegaConf.select(sweep_config, "hydra.launcher.backend"))
    restart = restart_from(OmegaConf.select(sweep_config, "hydra.launcher.restart"))
    return Job(idx=idx, overrides=overrides, config=sweep_config, backend=backend, restart=restart)


def _preflight(launcher: Any, jobs: List[Job]) -> None:
    problems: List[str] = []
    for job in jobs:
        HydraConfig.instance().set_config(job.config)
        found = job.backend.problems() + job.restart.problems()
        hook = OmegaConf.select(job.config, "hydra.launcher.preflight")
        if hook and not found:
            module, _, name = str(hook).partition(":")
            found += list(getattr(importlib.import_module(module), name)(job.config))
        prefix = f"{job.label}: " if len(jobs) > 1 else ""
        problems += [prefix + p for p in found]
    if problems:
        raise ConfigError(problems)


def _describe(backend: BackendConf) -> str:
    if backend.name == "local":
        return "1 in-process worker (backend=local)"
    return f"{backend.procs_per_node} {backend.name} workers"


def _run_job_distributed(job: Job, task_function: TaskFunction, task_cfg: DictConfig) -> Any:
    """Runs in the launcher process, inside Hydra's run_job (output folder made, HydraConfig set)."""
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with _RunLock(run_dir):
        frozen = OmegaConf.create(OmegaConf.to_container(task_cfg, resolve=True, enum_to_str=True))
        _atomic_write(run_dir / contract.CONFIG_FILE, OmegaConf.to_yaml(frozen))
        payload = cloudpickle.dumps((task_function, frozen, job.config, Singleton.get_state()))
        env = {
            contract.ENV_BACKEND: job.backend.name,
            contract.ENV_RUN_DIR: str(run_dir),
            contract.ENV_LAUNCH_TIME: repr(started),
        }
        adapter = _adapter(job.backend.name)
        contract.append_event(run_dir, "launch", backend=job.backend.name, overrides=filter_overrides(job.overrides))
        log.info("Run folder: %s", run_dir)
        attempts = 1 if adapter.RESTARTS_ITSELF else job.restart.max_restarts + 1
        first_failure: Optional[str] = None
        for attempt in range(attempts):
            env[contract.ENV_ATTEMPT] = str(attempt)
            if attempt:
                contract.append_event(run_dir, "relaunch", attempt=attempt, cause=last.args[0])
                log.warning("Relaunching %s (restart %d of %d)", job.label, attempt, job.restart.max_restarts)
            try:
                result = adapter.run(payload, job, env, run_dir)
                contract.append_event(run_dir, "job_completed", relaunches=attempt)
                return result
            except WorkerFailure as failure:
                last = failure
                first_failure = first_failure or _first_recorded_failure(run_dir, started) or failure.args[0]
        restarts = last.restarts if adapter.RESTARTS_ITSELF else attempts - 1
        message = f"{job.label} failed after {restarts} restart(s) (restart.max_restarts={job.restart.max_restarts}). "
        if first_failure and first_failure != last.args[0]:
            message += f"First failure: {first_failure}. Last failure: {last.args[0]}"
        else:
            message += f"Cause: {last.args[0]}"
        contract.append_event(run_dir, "job_failed", restarts=restarts, error=message)
        _record_failure(run_dir, message, restarts, time.time() - started)
        raise JobFailed(f"{message}\nRun folder: {run_dir} (logs under logs/, events in {contract.EVENTS_FILE})")


def _adapter(name: str) -> Any:
    if name == "torchrun":
        from . import _torchrun as adapter
    elif name == "horovod":
        from . import _horovod as adapter
    else:
        from . import _local as adapter
    return adapter


def _first_recorded_failure(run_dir: Path, since: float) -> Optional[str]:
    """The earliest failure a worker recorded in this launch (workers killed by a signal record none)."""
    try:
        lines = (run_dir / contract.EVENTS_FILE).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "worker_failed" and event.get("time", 0) >= since:
            return f"rank {event.get('rank')} on {event.get('host')}: {event.get('error')} (at {event.get('where')})"
    return None


def _record_failure(run_dir: Path, message: str, restarts: int, wall: float) -> None:
    summary: Dict[str, Any] = {}
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        pass
    summary.update(status="failed", error=message, restarts=restarts, wall_seconds=round(wall, 3))
    _atomic_write(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _RunLock:
    """One launch per run folder: a second launch on the same folder refuses to start.

    flock is released by the kernel when the holder dies, so a crashed launch never leaves a
    lock that blocks the next one; the file only tells the refused launch who holds it.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd = -1

    def __enter__(self) -> "_RunLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(self.fd, 512).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise JobFailed(
                f"Run folder {self.path.parent} is in use by {owner}. "
                "Wait for that launch to end, or choose another run.name."
            ) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        return self

    def __exit__(self, *exc: Any) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing releases the flock
