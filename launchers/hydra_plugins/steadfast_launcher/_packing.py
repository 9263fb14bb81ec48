"""Packing a parallel sweep's jobs onto this machine: its GPUs (each job gets its own, through
CUDA_VISIBLE_DEVICES), else the CPU cores this process may use (each job pinned to its own), or
hydra.launcher.max_procs abstract slots. Cheap: no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple


@dataclass
class Machine:
    """What parallel jobs are packed into: `units` are GPU ids, CPU ids, or abstract slots."""

    kind: str  # "gpu", "cpu" or "slots"
    units: List[int]
    labels: List[str] = field(default_factory=list)  # gpu: the ids to put in CUDA_VISIBLE_DEVICES
    free: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(self.units)

    @property
    def capacity(self) -> int:
        return len(self.units)

    def fits(self, procs: int, running: int) -> bool:
        """A job needing more than the whole machine runs alone."""
        if procs > self.capacity:
            return running == 0
        return procs <= len(self.free)

    def take(self, procs: int) -> List[int]:
        n = min(procs, len(self.free))
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, units: List[int]) -> None:
        self.free = sorted(set(self.free) | set(units))


def visible_gpus() -> List[str]:
    """GPU ids this process may use, without importing torch: CUDA_VISIBLE_DEVICES, else the driver's list."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for part in (p.strip() for p in env.split(",")):
            if not part or part.startswith("-"):  # CUDA stops at the first invalid id
                break
            ids.append(part)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def machine(max_procs: Optional[int]) -> Machine:
    if max_procs is not None:
        return Machine("slots", list(range(max_procs)))
    gpus = visible_gpus()
    if gpus:
        return Machine("gpu", list(range(len(gpus))), labels=gpus)
    cpus = sorted(os.sched_getaffinity(0))
    return Machine("cpu", cpus, labels=[str(c) for c in cpus])


def pick(
    pending: Sequence[Tuple[int, int]],
    machine: Machine,
    running: int,
    max_parallel: int,
    busy: Iterable[Any] = (),
    folders: Optional[Dict[int, Any]] = None,
) -> Optional[int]:
    """The first pending job (idx, procs) that fits now, or None: first-fit, in sweep order.

    Jobs whose run folder is in use by a running job wait (identical trials of a sweeper).
    """
    if running >= max_parallel:
        return None
    busy = set(busy)
    for idx, procs in pending:
        if folders is not None and folders.get(idx) in busy:
            continue
        if machine.fits(procs, running):
            return idx
    return None
