"""The one interface between the launcher and a way of starting workers (in the spirit of torch
elastic's agent and submitit's executors): everything that differs between backends is here,
and nothing outside `_backends/` asks which backend a job uses."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Type

from steadfast.contract.schemas import BackendConf

from .._payload import PayloadRef
from .._types import Job


class Backend(ABC):
    """One job's backend, built from its typed config (`backend.*`) by the registry.

    `launch` starts the workers of one attempt with `env` (the contract's LaunchEnv plus what the
    backend adds) and returns rank 0's value (None on a node without rank 0), or a `Stopped`
    marker; it raises `WorkerFailure` (its message names the root cause) or `Interrupted`.
    """

    schema: ClassVar[Type[BackendConf]]  # the backend's schema in steadfast.contract.schemas
    collective: ClassVar[str]  # what its workers initialise: steadfast.contract.env TORCH, HOROVOD or NONE
    restarts_itself: ClassVar[bool] = (
        False  # True: it restarts failed workers (restart.max_restarts); else the launcher relaunches
    )
    in_process: ClassVar[bool] = False  # True: the worker is the launcher's own thread (no supervisor, no forwarding)

    def __init__(self, conf: BackendConf) -> None:
        self.conf = conf

    @property
    def name(self) -> str:
        return self.conf.name

    @property
    def procs_per_node(self) -> int:
        return self.conf.procs_per_node

    def problems(self) -> List[str]:
        """Why this job cannot run on this backend (the schema's checks and the backend's own), before any worker starts."""
        return self.conf.problems()

    def describe(self) -> str:
        """How a job runs, for the launcher's log: 'on <this>'."""
        return f"{self.procs_per_node} {self.name} workers"

    def reference_world_size(self) -> int:
        """The job's full size (an elastic job's maximum): what keep_global_batch scales against."""
        return self.procs_per_node

    def multi_node_identity(self, run_dir: Path) -> Optional[str]:
        """What the launchers of one multi-node job agree on (None: one launcher per job)."""
        return None

    def log_folders(self, run_dir: Path) -> List[str]:
        """The backend's own logs, named in the launcher's first message."""
        return []

    @abstractmethod
    def launch(self, payload: PayloadRef, job: Job, env: Dict[str, str], run_dir: Path) -> Any:
        """Start one attempt's workers and wait for them."""

    def stop_on_grace_expired(self) -> bool:
        """The workers did not stop within restart.preemption_grace_s: have the backend stop them
        (True), or leave it to the supervisor, which kills them (False)."""
        return False

    def root_cause(self, error: BaseException, run_dir: Path, attempt: int = 0) -> str:
        """One line naming the first failed worker and why, from the backend's own failure report
        (`attempt`: the launcher's relaunch it happened in)."""
        return f"{type(error).__name__}: {error}"


def saved_environment(keys: Iterable[str]) -> Dict[str, Optional[str]]:
    """The launcher's values of the variables a launch is about to set (None: unset)."""
    return {k: os.environ.get(k) for k in keys}


def restore_environment(saved: Dict[str, Optional[str]]) -> None:
    """Put the launcher's environment back as `saved_environment` found it, after an attempt."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
