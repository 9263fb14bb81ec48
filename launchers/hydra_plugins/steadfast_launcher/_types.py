"""What the launcher's modules share: the job, the sweep settings, the ways a job ends.

A leaf: imports nothing of the launcher's own, only Hydra, OmegaConf and steadfast.contract.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from steadfast.contract.schemas import BackendConf, RestartConf


class JobFailed(CompactHydraException):
    """A job that failed after its restart budget; the message names the root cause."""

    def __init__(self, message: str, restarts: int = 0) -> None:
        super().__init__(message)
        self.restarts = restarts


class Refused(JobFailed):
    """A launch refused before it wrote anything (a folder in use, a lock the filesystem cannot take)."""


class Interrupted(KeyboardInterrupt):
    """A job (or the sweep) stopped by a signal; running the same command again resumes it."""

    def __init__(self, message: str = "", signum: Optional[int] = None) -> None:
        super().__init__(message or f"stopped by {signame(signum)}")
        self.signum = signum


class WorkerFailure(Exception):
    """Raised by a backend when the workers of one launch failed."""

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
    run_dir: Optional[Path] = None  # resolved by the launcher before anything runs
    key: str = ""  # identity in the sweep ledger (its overrides)
    digest: str = ""  # sha256 of its composed config: a changed config is not "completed"
    restarts: int = 0  # of the last launch, set by the job runner
    lock_dirs: List[Path] = field(default_factory=list)  # besides run_dir, held by the run lock

    @property
    def label(self) -> str:
        shown = " ".join(filter_overrides(self.overrides)) or "(defaults)"
        return f"job #{self.idx} [{shown}]"

    @property
    def procs(self) -> int:
        return self.backend.procs_per_node


@dataclass
class Settings:
    """The sweep-level fields of hydra.launcher (read from the sweep's config, not per job)."""

    max_parallel_jobs: int = 1
    max_procs: Optional[int] = None
    fail_fast: bool = False
    skip_completed: bool = True


def signame(signum: Optional[int]) -> str:
    try:
        return signal.Signals(signum).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "a signal"


def first_line(exc: Any) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def job_return(job: Job, status: JobStatus, value: Any) -> JobReturn:
    """A JobReturn for a job that did not go through run_job now (skipped, refused, not run, interrupted)."""
    cfg = job.config.copy()
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(job.run_dir)
    ret = JobReturn()
    task_cfg = cfg.copy()
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    ret.cfg = task_cfg
    ret.hydra_cfg = OmegaConf.masked_copy(cfg, "hydra")  # as HydraConfig holds it
    ret.overrides = list(job.overrides)
    ret.working_dir = str(job.run_dir) if OmegaConf.select(cfg, "hydra.job.chdir") else os.getcwd()
    ret.task_name = str(OmegaConf.select(cfg, "hydra.job.name"))
    ret.status = status
    ret.return_value = value
    return ret
