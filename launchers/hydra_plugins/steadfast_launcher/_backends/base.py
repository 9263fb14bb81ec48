"""The one interface between the launcher and a way of starting workers (in the spirit of torch
elastic's agent and submitit's executors): everything that differs between backends is in their
modules, and nothing outside `_backends/` asks which backend a job uses."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Mapping, Optional

from steadfast.contract.backends import BackendConf, BackendSpec
from steadfast.contract.env import ENV_ATTEMPT
from steadfast.contract.schemas import RestartConf

from .._payload import PayloadRef
from .._types import ExitObserver, Outcome


@dataclass(frozen=True)
class Attempt:
    """One launch of a job's workers, as a backend gets it."""

    entry: Callable[..., Any]  # what every rank runs (the launcher's worker: _worker.run_rank)
    payload: PayloadRef  # the job's task, frozen config and Hydra state, for `entry`
    env: Dict[str, str]  # the contract's LaunchEnv and the launcher's additions, for every worker
    run_dir: Path
    restart: RestartConf
    # the launcher's supervisor: a backend that learns how each worker ended when it finds a failure
    # hands it every worker's exit status (torch elastic's agent; Horovod's runner does not)
    on_exits: Optional[ExitObserver] = None

    @property
    def number(self) -> int:
        """The launcher's relaunch this is (0: the first launch)."""
        return int(self.env.get(ENV_ATTEMPT, "0"))


class Backend(ABC):
    """One job's backend, built from its typed config (`backend.*`) by `of`.

    `launch` starts the workers of one attempt and returns how it ended: Completed (rank 0's value;
    None on a node without rank 0), Stopped (the workers saved and stopped on purpose, or a stop
    request stopped the backend) or Failed (its cause names the first failed worker).
    """

    spec: ClassVar[BackendSpec]  # its schema, world-size keys, rank variables: what the contract knows
    restarts_itself: ClassVar[bool] = (
        False  # True: it restarts failed workers (restart.max_restarts); else the launcher relaunches
    )
    in_process: ClassVar[bool] = False  # True: the worker is the launcher's own thread (no supervisor, no forwarding)

    def __init__(self, conf: BackendConf) -> None:
        self.conf = conf

    @classmethod
    def warm_up(cls, node: Mapping[str, Any]) -> None:
        """Called when Hydra sets the launcher up, with the sweep's own `backend` node (a guess at what
        its jobs use): start what the launch will need, while Hydra composes and checks the jobs."""
        return None

    @property
    def name(self) -> str:
        return self.conf.name

    @property
    def collective(self) -> str:
        return self.spec.collective

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
    def launch(self, attempt: Attempt) -> Outcome:
        """Start one attempt's workers, wait for them, say how it ended (never raises for the workers' sake)."""

    def stop_on_grace_expired(self) -> bool:
        """The workers did not stop within restart.preemption_grace_s: have the backend stop them
        (True), or leave it to the supervisor, which kills them (False)."""
        return False

    def stop_restarting(self) -> bool:
        """A failure that would come back on every attempt: a backend that restarts the group itself
        stops it now, and its `launch` returns Failed (True). Called from the supervisor's thread."""
        return False


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
