"""CPU accounting for the benchmarks: how much of the machine other tenants used during a run, and
the CPU time of a run's process tree over time (the low-noise view of what a step costs)."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def cpu_counters() -> Tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, stolen by the hypervisor, used by our finished children)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (user + nice + system + irq + softirq) / tick, steal / tick, ru.ru_utime + ru.ru_stime


def foreign_load(before: Tuple[float, float, float], wall: float, ours: Optional[float] = None) -> Dict[str, float]:
    """How much of the machine other tenants used during a run (our own process tree left out). `ours`:
    our CPU seconds when our workers are not our children (forked by a forkserver), so their rusage
    is not ours to read; by default, this process's and its children's."""
    busy, steal, children = (b - a for a, b in zip(before, cpu_counters()))
    ours = children if ours is None else ours
    capacity = max(wall, 1e-9) * (os.cpu_count() or 1)
    return {
        "our_cpu_s": round(ours, 2),
        "foreign_cpu_s": round(max(0.0, busy - ours), 2),
        "steal_s": round(steal, 2),
        "foreign_share": round(max(0.0, busy - ours + steal) / capacity, 3),
    }


class CpuSampler(threading.Thread):
    """Samples the CPU time (user + system) of a process and of its descendants every `period` s.

    Unlike wall-clock speed, CPU seconds per step hardly move when other tenants take the
    cores: it is the low-noise measure of what each step costs. Processes that end keep their
    last reading, so the sums only grow.
    """

    def __init__(self, root: int, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.stop = threading.Event()
        self.samples: List[Tuple[float, float, float]] = []  # (time, root's CPU s, descendants' CPU s)
        self._last: Dict[int, float] = {}
        self._tick = os.sysconf("SC_CLK_TCK")

    def _read(self) -> Tuple[float, float]:
        tree, frontier = [], [self.root]
        while frontier:  # walk down /proc/<pid>/task/<tid>/children (cheaper than scanning /proc)
            pid = frontier.pop()
            tree.append(pid)
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    frontier.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
        for pid in tree:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                cpu = (int(fields[11]) + int(fields[12])) / self._tick
            except (OSError, ValueError, IndexError):
                continue
            self._last[pid] = max(self._last.get(pid, 0.0), cpu)
        root = self._last.get(self.root, 0.0)
        return root, sum(v for pid, v in self._last.items() if pid != self.root)

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.time()
            root, rest = self._read()
            self.samples.append((t, root, rest))
            self.stop.wait(self.period)

    def at(self, t: float) -> Optional[Tuple[float, float]]:
        """(root, descendants) CPU seconds at time t, linearly interpolated between samples."""
        s = self.samples
        if len(s) < 2 or not s[0][0] <= t <= s[-1][0]:
            return None
        for a, b in zip(s, s[1:]):
            if a[0] <= t <= b[0]:
                w = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 0.0
                return a[1] + w * (b[1] - a[1]), a[2] + w * (b[2] - a[2])
        return None
