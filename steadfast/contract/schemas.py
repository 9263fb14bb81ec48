"""Typed schemas of the launch settings every backend shares, the restart and cluster groups, and the
helpers a config check words its problems with (cheap: plain dataclasses, no torch, no Hydra).

Public, so that apps and the worker side name them without importing the launcher's private
modules. Each backend's own schema lives with the backend (steadfast.contract.backends is the
registry); the launcher's own node (`hydra/launcher=steadfast`) lives in the launcher's config.py,
as with Hydra's own launcher plugins. The launcher reads the app's `backend`, `restart` and `cluster`
nodes (`hydra.launcher.backend: ${backend}`, wired by the library's `steadfast` config), so a sweep
can vary them per job; without them, a job runs on the default backend (one in-process worker) with
no restarts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, List, Optional

MISSING = "???"  # a value the config must set: OmegaConf's own mark (omegaconf.MISSING is this string)


def bad(key: str, value: Any, allowed: str) -> str:
    return f"{key}={value!r} is not allowed: {allowed}"


# The bounds every numeric key of every schema is held to (bounded(), shared by all the config checks):
# a count must fit the int64 the workers put it in (tensors, step counters), a number of seconds
# (any float, and an integer whose key ends in `_s`) must be finite and fit timedelta (threading and
# torch timeouts are built from it).
INT_MAX = 2**63 - 1
FLOAT_MAX = timedelta.max.total_seconds()


def out_of_bounds(key: str, value: Any) -> Optional[str]:
    """The problem when a number cannot be held by the code consuming it (None: fine, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and key.endswith("_s"):
        if abs(value) <= FLOAT_MAX:
            return None
        return bad(key, value, f"seconds between {-FLOAT_MAX:g} and {FLOAT_MAX:g}")
    if isinstance(value, int):
        if -INT_MAX - 1 <= value <= INT_MAX:
            return None
        return bad(key, value, f"an integer between {-INT_MAX - 1} and {INT_MAX} (int64)")
    if math.isfinite(value) and abs(value) <= FLOAT_MAX:
        return None
    return bad(key, value, f"a finite number between {-FLOAT_MAX:g} and {FLOAT_MAX:g}")


def bounded(prefix: str, node: Any) -> List[str]:
    """Every numeric field of a schema dataclass (nested dataclasses and lists too) checked by out_of_bounds."""
    out: List[str] = []
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            out += bounded(f"{prefix}.{f.name}" if prefix else f.name, getattr(node, f.name))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            out += bounded(f"{prefix}[{i}]", item)
    elif isinstance(node, str) and not isinstance(node, Enum):
        try:  # a number given as text to an Any key (checkpoint.every_n_seconds)
            problem = out_of_bounds(prefix, float(node))
        except ValueError:
            problem = None
        out += [problem] if problem else []
    else:
        problem = out_of_bounds(prefix, node)
        out += [problem] if problem else []
    return out


def positive(key: str, value: Any, allow_none: bool = False) -> List[str]:
    """[] when `value` is a number > 0 (or None where that is allowed), else the problem."""
    if value is None and allow_none:
        return []
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return [bad(key, value, "a number > 0" + (", or null to disable" if allow_none else ""))]
    return []


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
    # The exit code after a stop request (SIGTERM/SIGHUP) once the stop step is committed. null: 75
    # (EX_TEMPFAIL) from the steadfast launcher, 143 in library mode (under torchrun, srun, a
    # PyTorchJob: what Kubernetes' training operator retries). See docs/platforms.md.
    preemption_exit_code: Optional[int] = None

    def problems(self, prefix: str = "restart") -> List[str]:
        out = bounded(prefix, self)
        if out:
            return out
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
        if self.preemption_exit_code is not None and not 1 <= self.preemption_exit_code <= 255:
            out.append(bad(f"{prefix}.preemption_exit_code", self.preemption_exit_code, "an exit code 1-255, or null"))
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
        out = bounded(prefix, self)
        if out:
            return out
        if self.name != "slurm":
            return [bad(f"{prefix}.name", self.name, "one of none, slurm")]
        out = []
        for key in ("nodes", "time_min", "signal_grace_s"):
            if getattr(self, key) < 1:
                out.append(bad(f"{prefix}.{key}", getattr(self, key), "an integer >= 1"))
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            out.append(bad(f"{prefix}.min_nodes", self.min_nodes, f"1 <= min_nodes <= {prefix}.nodes, or null"))
        return out
