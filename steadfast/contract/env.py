"""The launch environment: what the launcher tells every worker, as one typed object.

The launcher builds a `LaunchEnv` per launch and exports it with `to_environ()`; a worker reads it
back with `LaunchEnv.current()`. Besides these, each backend sets its own variables (torch
elastic's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT; Horovod's
HOROVOD_RANK, HOROVOD_SIZE, ...); `rank`, `world_size`, `local_rank` and `local_world_size` read
whichever the backend set, so a worker never needs to know which backend started it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional

ENV_BACKEND = "STEADFAST_BACKEND"  # the launcher's backend (torchrun, horovod, local): for records
ENV_COLLECTIVE = "STEADFAST_COLLECTIVE"  # the collective library a worker initialises (COLLECTIVES)
ENV_RUN_DIR = "STEADFAST_RUN_DIR"  # the job's output folder (absolute); the launcher created it
ENV_ATTEMPT = "STEADFAST_ATTEMPT"  # how many times the launcher itself relaunched this job (0 first)
ENV_LAUNCH_TIME = "STEADFAST_LAUNCH_TIME"  # when the launcher started this job (seconds since the epoch)
ENV_LAUNCH_ID = "STEADFAST_LAUNCH_ID"  # tells this launch's heartbeats from an earlier launch's
ENV_REFERENCE_WORLD_SIZE = "STEADFAST_REFERENCE_WORLD_SIZE"  # the job's full size (elastic: its maximum)
ENV_COLLECTIVE_TIMEOUT = "STEADFAST_COLLECTIVE_TIMEOUT_S"  # restart.collective_timeout_s
ENV_SNAPSHOT = "STEADFAST_SNAPSHOT"  # the launch's private snapshot folder in shared memory, a name in shm.SHM_DIR (empty: none)
ENV_LAUNCHER_PID = "STEADFAST_LAUNCHER_PID"  # the launcher process on this host: workers never commit once it is gone

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
        }

    @classmethod
    def from_environ(cls, env: Optional[Mapping[str, str]] = None) -> "LaunchEnv":
        env = os.environ if env is None else env
        run_dir = env.get(ENV_RUN_DIR)
        if not run_dir:
            raise NotLaunched(
                f"{ENV_RUN_DIR} is not set: run this task through the steadfast launcher "
                "(an app whose config selects hydra/launcher=steadfast)"
            )
        collective = env.get(ENV_COLLECTIVE) or NONE
        try:
            launch_time = float(env.get(ENV_LAUNCH_TIME) or 0.0)
            timeout = float(env.get(ENV_COLLECTIVE_TIMEOUT) or 600.0)
        except ValueError:
            launch_time, timeout = 0.0, 600.0
        return cls(
            backend=env.get(ENV_BACKEND) or "local",
            collective=collective if collective in COLLECTIVES else NONE,
            run_dir=Path(run_dir),
            attempt=_int(env, ENV_ATTEMPT, default=0),
            launch_time=launch_time,
            launch_id=env.get(ENV_LAUNCH_ID, ""),
            reference_world_size=_int(env, ENV_REFERENCE_WORLD_SIZE, default=1),
            collective_timeout_s=timeout,
            snapshot=env.get(ENV_SNAPSHOT, ""),
            launcher_pid=_int(env, ENV_LAUNCHER_PID, default=0),
        )

    @classmethod
    def current(cls) -> "LaunchEnv":
        return cls.from_environ(os.environ)

    # What the backend set (read live: an elastic restart changes them between incarnations).
    @property
    def rank(self) -> int:
        return _int(os.environ, "RANK", "HOROVOD_RANK", default=0)

    @property
    def world_size(self) -> int:
        return _int(os.environ, "WORLD_SIZE", "HOROVOD_SIZE", default=1)

    @property
    def local_rank(self) -> int:
        return _int(os.environ, "LOCAL_RANK", "HOROVOD_LOCAL_RANK", default=0)

    @property
    def local_world_size(self) -> int:
        return _int(os.environ, "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", default=1)

    def launcher_alive(self) -> bool:
        """False once the launcher that started this worker is gone (killed): an orphaned worker
        must not commit into a run folder that a new launch may already hold."""
        if not self.launcher_pid:
            return True
        try:
            os.kill(self.launcher_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie has exited too
            with open(f"/proc/{self.launcher_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return True

    @property
    def restart_count(self) -> int:
        """Restarts of this job so far: the launcher's relaunches plus the elastic agent's restarts."""
        return self.attempt + _int(os.environ, "TORCHELASTIC_RESTART_COUNT", default=0)


def current_rank() -> int:
    """This process's global rank, whichever backend started it (0 outside a launch)."""
    return _int(os.environ, "RANK", "HOROVOD_RANK", default=0)


def restart_count() -> int:
    return _int(os.environ, ENV_ATTEMPT, default=0) + _int(os.environ, "TORCHELASTIC_RESTART_COUNT", default=0)


def run_dir() -> Path:
    """The run folder of the current job (set by the launcher)."""
    return LaunchEnv.current().run_dir
