"""Typed schemas of the launcher and of the backend, restart and cluster groups (cheap: no torch).

Owned by the launcher, public so that apps and the worker side name them without importing the
launcher's private modules. An app selects the launcher with `override hydra/launcher: steadfast`
and the launcher reads the app's `backend`, `restart` and `cluster` nodes (`hydra.launcher.backend:
${backend}`, wired by the library's `steadfast` config), so a sweep can vary them per job. Without
them, a job runs in-process (`local`) with no restarts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

from hydra.errors import CompactHydraException
from omegaconf import MISSING, DictConfig, OmegaConf

RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")
CONTROLLERS = ("gloo", "mpi")


class ConfigError(CompactHydraException):
    """A configuration that cannot run; raised before any worker starts. Hydra prints it without a traceback."""

    def __init__(self, problems: List[str]) -> None:
        self.problems = problems
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems in the configuration:"
        rest = [] if len(problems) == 1 else [f"  - {p}" for p in problems]
        super().__init__("\n".join([f"Invalid config: {head}", *rest]))


def bad(key: str, value: Any, allowed: str) -> str:
    return f"{key}={value!r} is not allowed: {allowed}"


@dataclass
class BackendConf:
    """Base of the `backend` group; `name` says which adapter launches the workers."""

    name: str = MISSING

    def problems(self, prefix: str = "backend") -> List[str]:
        if self.name not in BACKEND_SCHEMAS:
            return [bad(f"{prefix}.name", self.name, f"one of {', '.join(BACKEND_SCHEMAS)}")]
        return []

    @property
    def procs_per_node(self) -> int:
        return 1


@dataclass
class LocalBackendConf(BackendConf):
    """One worker, in the launcher's own process: for debuggers and quick checks."""

    name: str = "local"


@dataclass
class TorchrunBackendConf(BackendConf):
    """torch elastic (the engine behind `torchrun`); keys mirror torchrun's flags."""

    name: str = "torchrun"
    nproc_per_node: int = 2
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""  # empty: a free local port, like `torchrun --standalone`
    rdzv_id: str = ""  # empty: the run folder's name, so every node of a job agrees
    rdzv_timeout_s: int = 900
    # Elastic jobs: once MIN nodes have joined a rendezvous round, how long it waits for more
    # (up to MAX) before it starts with what it has. null: torch's default (30 s).
    rdzv_last_call_s: Optional[int] = None
    # Elastic jobs: how long a node's agent may go silent before the other nodes take it for lost and
    # re-rendezvous without it (a keep-alive every third of it). null: torch's default (15 s).
    rdzv_node_timeout_s: Optional[int] = None
    master_addr: str = "127.0.0.1"  # only for rdzv_backend=static
    master_port: Optional[int] = None  # only for rdzv_backend=static
    node_rank: int = 0  # only for rdzv_backend=static
    local_addr: Optional[str] = None
    start_method: str = "forkserver"  # torch elastic forks its workers from a server that imported torch once

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node

    def node_range(self) -> tuple[int, int]:
        text = str(self.nnodes)
        low, _, high = text.partition(":")
        return int(low), int(high or low)

    def problems(self, prefix: str = "backend") -> List[str]:
        out = super().problems(prefix)
        if self.nproc_per_node < 1:
            out.append(bad(f"{prefix}.nproc_per_node", self.nproc_per_node, "an integer >= 1"))
        if not re.fullmatch(r"\d+(:\d+)?", str(self.nnodes)):
            out.append(bad(f"{prefix}.nnodes", self.nnodes, 'a node count "N" or a range "MIN:MAX"'))
        else:
            low, high = self.node_range()
            if low < 1 or high < low:
                out.append(bad(f"{prefix}.nnodes", self.nnodes, "1 <= MIN <= MAX"))
            elif high > 1 and not self.rdzv_endpoint and self.rdzv_backend != "static":
                out.append(f"{prefix}.nnodes={self.nnodes!r} needs {prefix}.rdzv_endpoint=HOST:PORT that every node can reach")
        if self.rdzv_backend not in RDZV_BACKENDS:
            out.append(bad(f"{prefix}.rdzv_backend", self.rdzv_backend, f"one of {', '.join(RDZV_BACKENDS)}"))
        if self.rdzv_backend == "static" and self.master_port is None:
            out.append(f"{prefix}.rdzv_backend='static' needs {prefix}.master_port")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            out.append(bad(f"{prefix}.master_port", self.master_port, "a TCP port, 1-65535"))
        if self.rdzv_endpoint and not re.fullmatch(r"[^:\s]+(:\d{1,5})?", self.rdzv_endpoint):
            out.append(bad(f"{prefix}.rdzv_endpoint", self.rdzv_endpoint, "HOST or HOST:PORT"))
        if self.rdzv_timeout_s < 1:
            out.append(bad(f"{prefix}.rdzv_timeout_s", self.rdzv_timeout_s, "seconds >= 1"))
        if self.rdzv_last_call_s is not None and self.rdzv_last_call_s < 1:
            out.append(bad(f"{prefix}.rdzv_last_call_s", self.rdzv_last_call_s, "seconds >= 1, or null (torch's 30 s)"))
        if self.rdzv_node_timeout_s is not None and self.rdzv_node_timeout_s < 3:
            out.append(bad(f"{prefix}.rdzv_node_timeout_s", self.rdzv_node_timeout_s, "seconds >= 3, or null (torch's 15 s)"))
        if self.start_method not in START_METHODS:
            out.append(bad(f"{prefix}.start_method", self.start_method, f"one of {', '.join(START_METHODS)}"))
        return out


@dataclass
class HorovodBackendConf(BackendConf):
    """Horovod over Gloo; keys mirror `horovodrun`'s flags."""

    name: str = "horovod"
    np: int = 2
    hosts: Optional[str] = None  # default: localhost:<np>
    controller: str = "gloo"
    start_timeout: int = 30
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    network_interface: Optional[str] = None
    reset_limit: Optional[int] = None
    blacklist_cooldown_range: Optional[List[int]] = None

    @property
    def procs_per_node(self) -> int:
        return self.np

    def problems(self, prefix: str = "backend") -> List[str]:
        out = super().problems(prefix)
        if self.np < 1:
            out.append(bad(f"{prefix}.np", self.np, "an integer >= 1"))
        if self.controller not in CONTROLLERS:
            out.append(bad(f"{prefix}.controller", self.controller, f"one of {', '.join(CONTROLLERS)}"))
        elif self.controller == "mpi":
            out.append(
                bad(f"{prefix}.controller", "mpi", "only 'gloo' is built here (the MPI controller needs an MPI build of Horovod)")
            )
        if self.start_timeout < 1:
            out.append(bad(f"{prefix}.start_timeout", self.start_timeout, "seconds >= 1"))
        if self.hosts and self.host_discovery_script:
            out.append(f"{prefix}.hosts and {prefix}.host_discovery_script are mutually exclusive: set one")
        if self.hosts and not re.fullmatch(r"[^,:\s]+(:\d+)?(,[^,:\s]+(:\d+)?)*", self.hosts):
            out.append(bad(f"{prefix}.hosts", self.hosts, "HOST:SLOTS[,HOST:SLOTS...]"))
        for key in ("min_np", "max_np", "reset_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                out.append(bad(f"{prefix}.{key}", value, "an integer >= 1, or null"))
        if self.min_np is not None and self.max_np is not None and self.min_np > self.max_np:
            out.append(f"{prefix}.min_np={self.min_np} is greater than {prefix}.max_np={self.max_np}")
        if self.min_np is not None and not self.host_discovery_script and len((self.hosts or "localhost").split(",")) < 2:
            # horovod.run refuses elastic mode on fixed hosts with fewer than 2 hosts
            out.append(
                f"{prefix}.min_np (elastic mode) needs {prefix}.host_discovery_script, or {prefix}.hosts with at least 2 hosts"
            )
        if self.blacklist_cooldown_range is not None and (
            len(self.blacklist_cooldown_range) != 2
            or not 0 <= self.blacklist_cooldown_range[0] <= self.blacklist_cooldown_range[1]
        ):
            out.append(
                bad(
                    f"{prefix}.blacklist_cooldown_range",
                    list(self.blacklist_cooldown_range),
                    "[MIN_S, MAX_S] with 0 <= MIN_S <= MAX_S",
                )
            )
        return out


@dataclass
class RestartConf:
    """What happens when a worker fails: backend-independent."""

    max_restarts: int = 3
    monitor_interval: float = 0.5  # seconds between the agent's checks on its workers
    # SIGTERM/SIGINT: how long the workers get to reach a step boundary, agree, save and exit
    # before they are killed (the newest committed checkpoint stays intact either way). Keep it
    # below the scheduler's own notice (Kubernetes and Slurm default to 30 s).
    preemption_grace_s: float = 25.0
    # A rank whose progress counter (steps, checkpoint files, validation batches) has not moved
    # for this long is declared hung: its stacks are written, it is killed, the group restarts.
    # null: no watchdog. Must exceed the longest legitimate pause (start-up, a restore).
    hang_timeout_s: Optional[float] = 300.0
    # The same for a worker that has not reached its first step yet (imports, rendezvous,
    # restoring a checkpoint), which can legitimately take longer. null: hang_timeout_s.
    startup_timeout_s: Optional[float] = 900.0
    # Deadline of every collective and barrier (torch.distributed's timeout, Horovod's stall
    # shutdown), so the peers of a lost rank never wait forever.
    collective_timeout_s: float = 600.0

    def problems(self, prefix: str = "restart") -> List[str]:
        out = []
        if self.max_restarts < 0:
            out.append(bad(f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0"))
        if not self.monitor_interval > 0:
            out.append(bad(f"{prefix}.monitor_interval", self.monitor_interval, "seconds > 0"))
        if not self.preemption_grace_s > 0:
            out.append(bad(f"{prefix}.preemption_grace_s", self.preemption_grace_s, "seconds > 0"))
        if self.hang_timeout_s is not None and not self.hang_timeout_s >= 1:
            out.append(bad(f"{prefix}.hang_timeout_s", self.hang_timeout_s, "seconds >= 1, or null to disable the watchdog"))
        if self.startup_timeout_s is not None and not self.startup_timeout_s >= 1:
            out.append(bad(f"{prefix}.startup_timeout_s", self.startup_timeout_s, "seconds >= 1, or null (hang_timeout_s)"))
        if not self.collective_timeout_s >= 1:
            out.append(bad(f"{prefix}.collective_timeout_s", self.collective_timeout_s, "seconds >= 1"))
        return out


@dataclass
class ClusterConf:
    """cluster=none (default): run here. cluster=slurm: submit each job to Slurm (see the launcher's _slurm.py)."""

    name: str = "none"
    nodes: int = 1  # one torch elastic agent per node (srun --ntasks-per-node=1)
    min_nodes: Optional[int] = None  # elastic: backend.nnodes=min_nodes:nodes (null: exactly nodes)
    time_min: int = 60  # the job's time limit (sbatch --time, minutes)
    partition: Optional[str] = None
    gpus_per_node: Optional[int] = None
    cpus_per_node: Optional[int] = None  # sbatch --cpus-per-task (one task per node)
    requeue: bool = True  # --requeue, and `scontrol requeue` after a stop before the time limit
    signal_grace_s: int = 120  # --signal=TERM@<this>: SIGTERM this long before the time limit
    rdzv_port: int = 29400  # the c10d rendezvous port on the allocation's first node
    extra_sbatch_args: List[str] = field(default_factory=list)  # e.g. ["--account=proj", "--qos=high"]
    submit: bool = True  # false: only write <run folder>/slurm/job.sbatch

    def problems(self, prefix: str = "cluster") -> List[str]:
        if self.name == "none":
            return []
        if self.name != "slurm":
            return [bad(f"{prefix}.name", self.name, "one of none, slurm")]
        out = []
        for key in ("nodes", "time_min", "signal_grace_s"):
            if getattr(self, key) < 1:
                out.append(bad(f"{prefix}.{key}", getattr(self, key), "an integer >= 1"))
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            out.append(bad(f"{prefix}.min_nodes", self.min_nodes, f"1 <= min_nodes <= {prefix}.nodes, or null"))
        return out


@dataclass
class SteadfastLauncherConf:
    _target_: str = "hydra_plugins.steadfast_launcher.launcher.SteadfastLauncher"
    # Apps point these at their own nodes (`${backend}`, `${restart}`) so sweeps can vary them.
    # Unset: one in-process worker (backend `local`) and no restarts.
    backend: Any = None
    restart: Any = None
    cluster: Any = None
    # The command each node runs under cluster=slurm: `python -m <app>` (null: the module or script
    # this launcher was started as).
    app: Optional[str] = None
    # Folders the job writes besides its run folder (e.g. a shared checkpoint.dir): the run lock
    # covers them too, so two launches never share them.
    lock_dirs: List[Any] = field(default_factory=list)
    # "package.module:function" (or a list of them) called with each job's config in the launcher
    # process before any worker starts; each returns a list of problems (empty when it can run).
    # `preflight` is the library's (set by its `steadfast` config), `app_preflight` the app's own:
    # an app adds its checks without dropping the library's.
    preflight: Any = None
    app_preflight: Any = None
    # Sweep-level settings (read from the sweep's config, not per job):
    # How many jobs run at once. Above 1, each job runs in its own launcher process and jobs
    # are packed by the worker processes they need (backend.procs_per_node) into max_procs.
    max_parallel_jobs: int = 1
    # Worker processes the machine runs at once. Default: its GPUs if it has any, else the CPU
    # cores this process may use; then each parallel job is also pinned to its own cores/GPUs.
    max_procs: Optional[int] = None
    # Stop the sweep at the first failed job (running jobs are stopped, resumable); default:
    # run every job, report the failures at the end and exit non-zero.
    fail_fast: bool = False
    # Re-running a sweep returns a completed job's recorded result (sweep ledger) instead of
    # launching it again; failed and interrupted jobs are launched again (and resume).
    skip_completed: bool = True

    def problems(self) -> List[str]:
        out = []
        if self.max_parallel_jobs < 1:
            out.append(bad("hydra.launcher.max_parallel_jobs", self.max_parallel_jobs, "an integer >= 1"))
        if self.max_procs is not None and self.max_procs < 1:
            out.append(
                bad("hydra.launcher.max_procs", self.max_procs, "an integer >= 1, or null (this machine's GPUs or CPU cores)")
            )
        return out


# The one map from a backend's name to its schema (the launcher's registry maps schemas to backends).
BACKEND_SCHEMAS: Dict[str, Type[BackendConf]] = {
    "torchrun": TorchrunBackendConf,
    "horovod": HorovodBackendConf,
    "local": LocalBackendConf,
}


def backend_from(node: Any) -> BackendConf:
    """A typed backend from a config node (typed or plain), or a ConfigError naming the problem."""
    if isinstance(node, BackendConf):
        return node
    if node is None:
        return LocalBackendConf()
    name = OmegaConf.select(node, "name") if isinstance(node, DictConfig) else (node or {}).get("name")
    schema = BACKEND_SCHEMAS.get(str(name))
    if schema is None:
        raise ConfigError([bad("backend.name", name, f"one of {', '.join(BACKEND_SCHEMAS)}")])
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))  # type: ignore[return-value]


def restart_from(node: Any) -> RestartConf:
    if isinstance(node, RestartConf):
        return node
    if node is None:
        return RestartConf(max_restarts=0)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RestartConf), node))  # type: ignore[return-value]


def cluster_from(node: Any) -> ClusterConf:
    if isinstance(node, ClusterConf):
        return node
    if node is None:
        return ClusterConf()
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConf), node))  # type: ignore[return-value]
