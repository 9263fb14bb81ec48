"""Platforms that start the workers themselves, and how a worker recognises one (library mode).

A steadfast app started by torch elastic (`torchrun`, and what runs it: a PyTorchJob's pods,
TorchX's `dist.ddp`), by Slurm's `srun` with one task per worker, in a Ray Train worker
(steadfast/ray_train.py runs it there), or by any platform that sets
torch's own variables (a PyTorchJob without torchrun) is one rank of a job that platform owns. The
launcher then runs the job's task in that process instead of starting workers of its own (library
mode, docs/platforms.md). This table says, per platform, how it is recognised, where a worker finds
its rank, who it is within the job, and which variables torch.distributed still needs.

One entry per platform (`PLATFORMS`), tried in order: the first that recognises the environment
wins (torch elastic under srun is torch elastic's worker). A new platform is one more entry. Plain
data: no torch, no Hydra.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Callable, Dict, Mapping, Optional, Tuple

from .backends import TORCH_DISTRIBUTED, RankEnv
from .env import ENV_RUN_DIR

ENV_LAUNCHER_TASKS = "STEADFAST_LAUNCHER_TASKS"  # set by the launcher's own sbatch script: its srun tasks are launchers

Environ = Mapping[str, str]


def _get(env: Environ, name: str) -> str:
    return env.get(name) or ""


def _int(env: Environ, name: str, default: int = 0) -> int:
    try:
        return int(env.get(name) or default)
    except ValueError:
        return default


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ('gpu[03-05,09],cpu1' -> 'gpu03'), as `scontrol show hostnames` lists it."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist.strip())
    if not m:
        return ""
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


@dataclass(frozen=True)
class Platform:
    """One way of starting workers that is not ours."""

    name: str
    title: str  # what started the workers, for messages: "torchrun (torch elastic)"
    restarts: str  # who restarts a failed worker, in a few words (messages and docs)
    rank_env: RankEnv  # torch's variables (set by the platform or from torch_env) and the platform's own
    recognises: Callable[[Environ], bool]
    job: Callable[[Environ], str]  # what every worker of one job agrees on without talking to the others
    node: Callable[[Environ], str]  # this worker's node in the job (shared memory is per node)
    torch_env: Callable[[Environ], Dict[str, str]] = lambda env: {}  # torch's variables it does not set itself


def _torch_job(env: Environ) -> str:
    return f"{_get(env, 'MASTER_ADDR')}:{_get(env, 'MASTER_PORT')}"


def _slurm_torch_env(env: Environ) -> Dict[str, str]:
    """torch.distributed's variables from Slurm's (those the job script set itself are kept)."""
    ntasks, nodes = _int(env, "SLURM_NTASKS", 1), max(1, _int(env, "SLURM_JOB_NUM_NODES", 1))
    derived = {
        "RANK": _get(env, "SLURM_PROCID"),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": _get(env, "SLURM_LOCALID") or "0",
        "LOCAL_WORLD_SIZE": str(max(1, ntasks // nodes)),
        "MASTER_ADDR": first_host(_get(env, "SLURM_STEP_NODELIST") or _get(env, "SLURM_JOB_NODELIST")) or "127.0.0.1",
        "MASTER_PORT": str(20000 + _int(env, "SLURM_JOB_ID") % 20000),  # the same on every task of the job
    }
    return {k: v for k, v in derived.items() if not env.get(k)}


TORCH_ELASTIC = Platform(
    name="torchelastic",
    title="torchrun (torch elastic)",
    restarts="torch elastic's agent (--max-restarts)",
    rank_env=TORCH_DISTRIBUTED,
    recognises=lambda env: bool(env.get("TORCHELASTIC_RUN_ID")) and bool(env.get("RANK")),
    job=lambda env: f"{_get(env, 'TORCHELASTIC_RUN_ID')}@{_torch_job(env)}",
    node=lambda env: _get(env, "GROUP_RANK") or "0",
)

SLURM = Platform(
    name="slurm",
    title="srun",
    restarts="the same srun command again, or a requeue of the job (--requeue)",  # nothing restarts a task
    # run again or requeued, each start is an incarnation of the launch: they count its restarts (after torch_env)
    rank_env=replace(TORCH_DISTRIBUTED, restart_count="", run_id="SLURM_JOB_ID"),
    recognises=lambda env: bool(env.get("SLURM_STEP_ID")) and bool(env.get("SLURM_PROCID")) and _int(env, "SLURM_NTASKS") > 1,
    job=lambda env: f"{_get(env, 'SLURM_JOB_ID')}.{_get(env, 'SLURM_STEP_ID')}",
    node=lambda env: _get(env, "SLURM_NODEID") or "0",
    torch_env=_slurm_torch_env,
)

RAY = Platform(  # a Ray Train TorchTrainer's worker: Ray sets torch's variables and initialises the group itself
    name="ray",
    title="Ray Train",
    restarts="Ray Train (RunConfig(failure_config=FailureConfig(max_failures=...)))",
    rank_env=replace(TORCH_DISTRIBUTED, restart_count="", run_id="RAY_JOB_ID"),  # a restart is a new group: incarnations
    recognises=lambda env: all(env.get(k) for k in ("RAY_JOB_ID", "RANK", "WORLD_SIZE")),
    job=lambda env: f"{_get(env, 'RAY_JOB_ID')}@{_torch_job(env)}",  # a restarted group meets on a new port
    node=lambda env: _get(env, "NODE_RANK") or "0",
)

TORCH_ENV = Platform(  # a PyTorchJob's pods without torchrun, and any launcher that sets only torch's variables
    name="torch-env",
    title="a platform that sets torch's variables (a PyTorchJob)",
    restarts="the platform (a PyTorchJob's restartPolicy restarts the pod)",
    rank_env=replace(TORCH_DISTRIBUTED, restart_count="", run_id=""),  # it counts no restarts
    recognises=lambda env: all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")),
    job=_torch_job,
    # one process per pod is the PyTorchJob's way: each is a node of its own (PET_NODE_RANK is torchrun's, not this)
    node=lambda env: str(_int(env, "RANK") // max(1, _int(env, "LOCAL_WORLD_SIZE", 1))),
)

PLATFORMS: Tuple[Platform, ...] = (TORCH_ELASTIC, SLURM, RAY, TORCH_ENV)


@dataclass(frozen=True)
class Detected:
    """A platform, with the variables this process was started with."""

    platform: Platform
    env: Mapping[str, str]

    @property
    def name(self) -> str:
        return self.platform.name

    @property
    def title(self) -> str:
        return self.platform.title

    def torch_environ(self) -> Dict[str, str]:
        return self.platform.torch_env(self.env)

    def _value(self, name: str, default: int) -> int:
        merged = {**self.env, **self.torch_environ()}
        return _int(merged, name, default)

    @property
    def rank(self) -> int:
        return self._value(self.platform.rank_env.rank, 0)

    @property
    def world_size(self) -> int:
        return self._value(self.platform.rank_env.world_size, 1)

    @property
    def job(self) -> str:
        """The job's identity: the same on every worker of one job; what its run lock is shared under."""
        return f"{self.name} {self.platform.job(self.env)}"

    @property
    def node(self) -> str:
        return self.platform.node(self.env)


def by_name(name: str) -> Optional[Platform]:
    return next((p for p in PLATFORMS if p.name == name), None)


def detect(env: Environ) -> Optional[Detected]:
    """The platform that started this process as one of its workers, or None: started by a person or
    a script (the launcher then starts the workers itself), or by the steadfast launcher (a worker of
    ours has STEADFAST_RUN_DIR), or one of the launchers our own sbatch script starts per node."""
    if env.get(ENV_RUN_DIR) or env.get(ENV_LAUNCHER_TASKS):
        return None
    found = next((p for p in PLATFORMS if p.recognises(env)), None)
    return Detected(found, dict(env)) if found is not None else None


def digest(*parts: str) -> str:
    """A short name for a tuple of values (folder names)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
