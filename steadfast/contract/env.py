"""The launch environment: what the launcher tells every worker, as one typed object.

The launcher builds a `LaunchEnv` per launch and exports it with `to_environ()`; a worker reads it
back with `LaunchEnv.current()`. Besides these, each backend sets its own variables for a worker's
rank, world size and restarts; the launcher names them in the LaunchEnv (`rank_env`, the backend's
RankEnv: see steadfast.contract.backends), and `rank`, `world_size`, `local_rank`, `local_world_size`
and `restart_count` read them, so a worker never needs to know which backend started it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional

from .backends import TORCH_DISTRIBUTED, RankEnv
from .pids import alive

ENV_BACKEND = "STEADFAST_BACKEND"  # the launcher's backend (its registered name): for records
ENV_COLLECTIVE = "STEADFAST_COLLECTIVE"  # the collective library a worker initialises (COLLECTIVES)
ENV_RUN_DIR = "STEADFAST_RUN_DIR"  # the job's output folder (absolute); the launcher created it
ENV_ATTEMPT = "STEADFAST_ATTEMPT"  # how many times the launcher itself relaunched this job (0 first)
ENV_LAUNCH_TIME = "STEADFAST_LAUNCH_TIME"  # when the launcher started this job (seconds since the epoch)
ENV_LAUNCH_ID = "STEADFAST_LAUNCH_ID"  # tells this launch's heartbeats from an earlier launch's
ENV_REFERENCE_WORLD_SIZE = "STEADFAST_REFERENCE_WORLD_SIZE"  # the job's full size (elastic: its maximum)
ENV_COLLECTIVE_TIMEOUT = "STEADFAST_COLLECTIVE_TIMEOUT_S"  # restart.collective_timeout_s
ENV_SNAPSHOT = "STEADFAST_SNAPSHOT"  # the launch's private snapshot folder in shared memory, a name in shm.SHM_DIR (empty: none)
ENV_LAUNCHER_PID = "STEADFAST_LAUNCHER_PID"  # the launcher process on this host: workers never commit once it is gone
ENV_RANK_ENV = "STEADFAST_RANK_ENV"  # the names of the backend's rank variables (a RankEnv, as JSON)
ENV_PLATFORM = "STEADFAST_PLATFORM"  # library mode: the platform that started the workers (contract/platforms.py); empty: ours

TORCH = "torch"  # torch.distributed (Gloo on CPU, NCCL on GPUs)
HOROVOD = "horovod"
NONE = "none"  # a single process
COLLECTIVES = (TORCH, HOROVOD, NONE)


class NotLaunched(RuntimeError):
    """This process was not started by the steadfast launcher."""


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return default


@dataclass(frozen=True)
class LaunchEnv:
    backend: str
    collective: str
    run_dir: Path
    attempt: int = 0
    launch_time: float = 0.0
    launch_id: str = ""
    reference_world_size: int = 1
    collective_timeout_s: float = 600.0
    snapshot: str = ""
    launcher_pid: int = 0
    rank_env: RankEnv = TORCH_DISTRIBUTED
    platform: str = ""  # library mode (docs/platforms.md): torch elastic, srun, a PyTorchJob started this worker

    def to_environ(self) -> Dict[str, str]:
        return {
            ENV_BACKEND: self.backend,
            ENV_COLLECTIVE: self.collective,
            ENV_RUN_DIR: str(self.run_dir),
            ENV_ATTEMPT: str(self.attempt),
            ENV_LAUNCH_TIME: repr(self.launch_time),
            ENV_LAUNCH_ID: self.launch_id,
            ENV_REFERENCE_WORLD_SIZE: str(self.reference_world_size),
            ENV_COLLECTIVE_TIMEOUT: repr(float(self.collective_timeout_s)),
            ENV_SNAPSHOT: self.snapshot,
            ENV_LAUNCHER_PID: str(self.launcher_pid),
            ENV_RANK_ENV: self.rank_env.to_json(),
            ENV_PLATFORM: self.platform,
        }

    @classmethod
    def from_environ(cls, env: Optional[Mapping[str, str]] = None) -> "LaunchEnv":
        env = os.environ if env is None else env
        run_dir = env.get(ENV_RUN_DIR)
        if not run_dir:
            raise NotLaunched(
                f"{ENV_RUN_DIR} is not set: run this task through the steadfast launcher (an app whose config "
                "selects hydra/launcher=steadfast: the library's `steadfast` config), which also runs it as one rank "
                "under torchrun, srun or a PyTorchJob (docs/platforms.md)"
            )
        collective = env.get(ENV_COLLECTIVE) or NONE
        try:
            launch_time = float(env.get(ENV_LAUNCH_TIME) or 0.0)
            timeout = float(env.get(ENV_COLLECTIVE_TIMEOUT) or 600.0)
        except ValueError:
            launch_time, timeout = 0.0, 600.0
        return cls(
            backend=env.get(ENV_BACKEND, ""),
            collective=collective if collective in COLLECTIVES else NONE,
            run_dir=Path(run_dir),
            attempt=_int(env, ENV_ATTEMPT, default=0),
            launch_time=launch_time,
            launch_id=env.get(ENV_LAUNCH_ID, ""),
            reference_world_size=_int(env, ENV_REFERENCE_WORLD_SIZE, default=1),
            collective_timeout_s=timeout,
            snapshot=env.get(ENV_SNAPSHOT, ""),
            launcher_pid=_int(env, ENV_LAUNCHER_PID, default=0),
            rank_env=rank_env(env),
            platform=env.get(ENV_PLATFORM, ""),
        )

    @classmethod
    def current(cls) -> "LaunchEnv":
        return cls.from_environ(os.environ)

    # What the backend set (read live: an elastic restart changes them between incarnations).
    @property
    def rank(self) -> int:
        return _int(os.environ, self.rank_env.rank, default=0)

    @property
    def world_size(self) -> int:
        return _int(os.environ, self.rank_env.world_size, default=1)

    @property
    def local_rank(self) -> int:
        return _int(os.environ, self.rank_env.local_rank, default=0)

    @property
    def local_world_size(self) -> int:
        return _int(os.environ, self.rank_env.local_world_size, default=1)

    @property
    def library_mode(self) -> bool:
        """A platform started this worker; no launcher of ours watches it (docs/platforms.md)."""
        return bool(self.platform)

    def launcher_alive(self) -> bool:
        """False once the launcher that started this worker is gone (killed): an orphaned worker
        must not commit into a run folder that a new launch may already hold."""
        return not self.launcher_pid or alive(self.launcher_pid)

    @property
    def restart_count(self) -> int:
        """Restarts of this job so far: the launcher's relaunches plus the backend's own restarts."""
        return self.attempt + _int(os.environ, self.rank_env.restart_count, default=0)


def rank_env(env: Optional[Mapping[str, str]] = None) -> RankEnv:
    """The rank variables the launcher named (torch.distributed's outside a launch)."""
    env = os.environ if env is None else env
    return RankEnv.from_json(env.get(ENV_RANK_ENV) or "") or TORCH_DISTRIBUTED


def current_rank() -> int:
    """This process's global rank, whichever backend started it (0 outside a launch)."""
    return _int(os.environ, rank_env().rank, default=0)


def restart_count() -> int:
    return _int(os.environ, ENV_ATTEMPT, default=0) + _int(os.environ, rank_env().restart_count, default=0)


def run_dir() -> Path:
    """The run folder of the current job (set by the launcher)."""
    return LaunchEnv.current().run_dir
