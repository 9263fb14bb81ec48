"""What the launcher's modules share: the job, the sweep settings, a launch's outcomes, the errors
Hydra reports, the typed settings read from a job's config.

A leaf: imports nothing of the launcher's own, only Hydra, OmegaConf and steadfast.contract.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Union

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from steadfast.contract.backends import BackendConf
from steadfast.contract.schemas import ClusterConf, RestartConf
from steadfast.contract.stop import Stopped, signal_name


class ConfigError(CompactHydraException):
    """A configuration that cannot run; raised before any worker starts. Hydra prints it without a traceback."""

    def __init__(self, problems: List[str]) -> None:
        self.problems = problems
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems in the configuration:"
        rest = [] if len(problems) == 1 else [f"  - {p}" for p in problems]
        super().__init__("\n".join([f"Invalid config: {head}", *rest]))


class JobFailed(CompactHydraException):
    """A job that failed after its restart budget; the message names the root cause."""

    def __init__(self, message: str, restarts: int = 0) -> None:
        super().__init__(message)
        self.restarts = restarts


class Refused(JobFailed):
    """A launch refused before it wrote anything (a folder in use, a lock the filesystem cannot take)."""


class Interrupted(KeyboardInterrupt):
    """A job (or the sweep) stopped by a signal; running the same command again resumes it. Raised
    where Python delivers a signal (a handler) and where a job's end goes back to Hydra."""

    def __init__(self, message: str = "", signum: Optional[int] = None) -> None:
        super().__init__(message or f"stopped by {signal_name(signum, unknown='a signal')}")
        self.signum = signum


# ---- how one launch of a job's workers ended (what Backend.launch returns) ----


@dataclass(frozen=True)
class Completed:
    value: Any  # rank 0's return value (None on a node that does not host rank 0)


@dataclass(frozen=True)
class Failed:
    cause: str  # the first failed worker and why (a job's end: the whole message for the person)
    restarts: int = 0  # restarts the backend made itself before it gave up
    recurs: Optional[str] = None  # it would fail the same way on every attempt: why it is not restarted


@dataclass(frozen=True)
class WorkerExit:
    """How one worker process ended, as its backend knows it when it finds a failure: by pid and local
    rank (torch elastic's agent), or by global rank only (Horovod's runner)."""

    exit_code: int  # negative: the signal that ended it
    stopped_by_backend: bool = False  # still running when the backend found the failure: the backend stopped it
    pid: Optional[int] = None
    local_rank: Optional[int] = None
    rank: Optional[int] = None


# The launcher's supervisor (Supervisor.worker_exits). It answers True when the failure would come back
# on every attempt and the backend, which restarts the group itself, must stop it instead.
ExitObserver = Callable[[List[WorkerExit]], bool]

# Stopped (steadfast.contract.stop): the workers saved and stopped on purpose (their StopRun), or
# the backend was stopped by a stop request (reason PREEMPTED).
Outcome = Union[Completed, Stopped, Failed]


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


def first_line(value: object) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else type(value).__name__


def restart_from(node: object) -> RestartConf:
    """The typed `restart` settings of a config node (plain or typed); none: no restarts."""
    if isinstance(node, RestartConf):
        return node
    if node is None:
        return RestartConf(max_restarts=0)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RestartConf), node))  # type: ignore[return-value]


def cluster_from(node: object) -> ClusterConf:
    """The typed `cluster` settings of a config node (plain or typed); none: run here."""
    if isinstance(node, ClusterConf):
        return node
    if node is None:
        return ClusterConf()
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConf), node))  # type: ignore[return-value]


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
