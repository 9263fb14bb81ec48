"""Stragglers: the rank whose own work makes the others wait, measured per step and named.

What a step boundary cannot see. Under DDP, Horovod and FSDP the gradient collective inside the
backward pass re-aligns the ranks at every step: the time between two step boundaries is the same
on every rank, and a process's CPU time does not tell a slowed rank from one that waits. What differs
is the work a rank does on its own before the step's first collective, its *local time*:

- loading the batch: from the previous step boundary (the end of `run.step`, or an epoch's start) to
  the start of the forward pass of the model `run.setup` returned (a forward pre-hook, put first, so
  it runs before a wrapper's own collectives: DDP's buffer broadcast, FSDP's all-gather; a DDP wrapper
  around a model with no buffers has none, and only the model inside is hooked);
- the forward pass itself, where it holds no collective (parallel=ddp, Horovod, parallel=none): a
  pre-hook and a hook on the model inside the wrapper. On the CPU two perf_counter reads; on CUDA a
  pair of CUDA events (the host only queues the forward: its clock would measure the launches), read
  once per logging window when they have completed, never waited for.

With gradient accumulation the step's last micro-batch counts: the earlier ones, backward included,
run without a collective, so they fall in "from the boundary to its forward". Under parallel=fsdp the
forward begins with an all-gather: only the time to the first forward counts. Without a model given
to `run.setup` there are no hooks: the local time is the time from one boundary to the next
`run.step`, which the gradient collective equalises (under data parallelism nothing is then named).

Under torch.compile the hooks compile to nothing (`torch.compiler.is_compiling()`, which Dynamo reads
as a constant): a clock read in a hook would be a graph break in the user's model. A model compiled
before `run.setup` (nanoGPT's order: the hooks sit on the compiled module, outside its graph) is timed
as above; one compiled after it (the hooks inside the compiled region) is timed as a loop without a
model: from one boundary to the next `run.step`.

Per step: two to four perf_counter reads and a few additions (on CUDA two event records), about 5 us
per forward on a CPU (8 us with a wrapper), nearly all of it PyTorch's hook dispatch; no collective.
Every logging window each rank's mean local time per step rides in the window's existing all-reduce
(metrics.py, a slot per rank), and every rank applies `StragglerRule` to the same numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn
from torch.compiler import is_compiling

# A rank must also be this many seconds per step slower than the others' median: scheduling jitter
# of a fraction of a millisecond on a tiny model never names anybody, whatever the ratio.
FLOOR_S = 0.002
MAX_PENDING = 4096  # CUDA event pairs kept unread (they complete in order; a stalled device drops the oldest)


class StepTimer:
    """This rank's local time per step (see the module doc); `window()` hands out the mean per step."""

    def __init__(self, cuda: bool = False, on_mark: Optional[Callable[[], None]] = None) -> None:
        self.cuda, self.on_mark = cuda, on_mark  # on_mark: at every boundary, part of the next step (fault=slow_rank)
        self._first_only = False  # fsdp: the forward holds collectives
        self._mark = time.perf_counter()  # the last step boundary
        self._arrival: Optional[float] = None  # this step's (last) forward start
        self._forward_start = 0.0
        self._forward = 0.0  # the last forward's seconds (CPU)
        self._pair: Optional[Tuple[Any, Any]] = None  # the last forward's CUDA events
        self._pending: List[Tuple[Any, Any]] = []
        self._free: List[Tuple[Any, Any]] = []
        self._sum, self._steps = 0.0, 0

    def watch(self, outer: nn.Module, inner: nn.Module, forward_is_local: bool) -> None:
        """Time the forward passes of `outer` (what the loop calls) and of `inner` (the model inside
        a wrapper; the same module when there is none: then one pre-hook does both, a hook costs
        about a microsecond)."""
        self._first_only = not forward_is_local
        if forward_is_local and outer is inner:
            outer.register_forward_pre_hook(self._arrive_and_begin, prepend=True)
        else:
            outer.register_forward_pre_hook(self._arrive, prepend=True)
            if forward_is_local:
                inner.register_forward_pre_hook(self._forward_begins)
        if forward_is_local:
            inner.register_forward_hook(self._forward_ends, prepend=True)

    def _arrive(self, module: nn.Module, args: Any) -> None:
        if is_compiling():  # traced by Dynamo: nothing (see the module doc)
            return
        if self._arrival is None or not self._first_only:
            self._arrival = time.perf_counter()

    def _arrive_and_begin(self, module: nn.Module, args: Any) -> None:
        if is_compiling():
            return
        self._arrival = time.perf_counter()
        self._forward_begins(module, args)

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        if is_compiling():
            return
        if self.cuda:
            import torch

            if self._pair is None:  # several forwards in a step: the last one's times
                self._pair = (
                    self._free.pop()
                    if self._free
                    else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
                )
            self._pair[0].record()
        else:
            self._forward_start = time.perf_counter()

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            return
        if self._pair is not None:
            self._pair[1].record()
        else:
            self._forward = time.perf_counter() - self._forward_start

    def step(self) -> None:
        """At a step boundary, before the library's own work: the step's local time into the window."""
        self._count(time.perf_counter())

    def boundary(self) -> None:
        """A step boundary with none of the library's own work: `step` and `mark` on one clock read
        (Telemetry.quiet_step does this inline while no CUDA events are pending)."""
        now = time.perf_counter()
        self._count(now)
        self._mark = now
        if self.on_mark is not None:
            self.on_mark()

    def _count(self, now: float) -> None:
        if self._arrival is None:  # no forward seen: the whole time since the last boundary
            self._sum += now - self._mark
        else:
            self._sum += self._arrival - self._mark + self._forward
        self._steps += 1
        if self._pair is not None:
            self._pending.append(self._pair)
            if len(self._pending) > MAX_PENDING:
                self._pending.pop(0)
        self._arrival, self._forward, self._pair = None, 0.0, None

    def mark(self) -> None:
        """A step boundary after the library's own work (or an epoch's start): the next step's local work begins."""
        if self._pair is not None:  # a forward outside the steps (validation): not this step's
            self._free.append(self._pair)
        self._arrival, self._forward, self._pair = None, 0.0, None
        self._mark = time.perf_counter()
        if self.on_mark is not None:
            self.on_mark()

    def window(self) -> float:
        """The mean local seconds per step since the last call (0.0 when no step was timed)."""
        mean = self._sum / self._steps if self._steps else 0.0
        self._sum, self._steps = 0.0, 0
        if self._pending:
            done = 0
            while done < len(self._pending) and self._pending[done][1].query():
                done += 1
            if done:
                read, self._pending = self._pending[:done], self._pending[done:]
                mean += sum(a.elapsed_time(b) for a, b in read) / 1000.0 / done
                self._free.extend(read)
        return mean


@dataclass(frozen=True)
class Straggler:
    rank: int
    local_s: float  # its mean local time per step in the window
    median_s: float  # the median of the other ranks' (> 0)

    @property
    def ratio(self) -> float:
        return self.local_s / self.median_s

    def fields(self, step: int, windows: int, recovered: bool) -> Dict[str, Any]:
        """The `straggler` event's fields (`step`: the last step of the window that decided)."""
        return {
            "rank": self.rank,
            "ratio": round(self.ratio, 3),
            "local_ms": round(1000 * self.local_s, 3),
            "median_ms": round(1000 * self.median_s, 3),
            "windows": windows,
            "step": step,
            "recovered": recovered,
        }


class StragglerRule:
    """A rank is slow in a window when its local time per step exceeds the median of the other ranks'
    by more than `margin` (a fraction) and by more than `floor_s`; slow for `windows` consecutive
    windows, it is named; named, it recovers after as many consecutive windows that are not slow.
    The median of the *other* ranks: with two ranks the median of all would be the mean of the two, and
    a rank twice as slow as its peer would show only +33%."""

    def __init__(self, margin: Optional[float], windows: Optional[int], floor_s: float = FLOOR_S) -> None:
        self.margin, self.windows, self.floor_s = margin or 0.0, max(1, windows or 1), floor_s
        self.named: Dict[int, Straggler] = {}
        self._runs: Dict[int, int] = {}  # rank -> consecutive windows slow (not named) or not slow (named)

    @property
    def on(self) -> bool:
        return self.margin > 0

    def update(self, local: Sequence[float]) -> Tuple[List[Straggler], List[Straggler]]:
        """One window's local seconds per step, one per rank: (the ranks named now, those recovered now)."""
        if not self.on or len(local) < 2 or min(local) <= 0:
            return [], []  # off, alone, or a window without timed steps
        named, recovered = [], []
        for rank, mine in enumerate(local):
            median = statistics.median(v for r, v in enumerate(local) if r != rank)
            now = Straggler(rank, mine, median)
            slow = mine > median * (1 + self.margin) and mine - median > self.floor_s
            was = rank in self.named
            if slow == was:
                self._runs[rank] = 0
                if was:
                    self.named[rank] = now  # the latest numbers, for the progress line
                continue
            self._runs[rank] = self._runs.get(rank, 0) + 1
            if self._runs[rank] < self.windows:
                continue
            self._runs[rank] = 0
            if was:
                del self.named[rank]
                recovered.append(now)
            else:
                self.named[rank] = now
                named.append(now)
        return named, recovered

    def describe(self) -> str:
        """The named ranks for the progress line ("rank 1 (+48%)"), empty when none."""
        slowest = sorted(self.named.values(), key=lambda s: -s.ratio)
        shown = ", ".join(f"rank {s.rank} (+{100 * (s.ratio - 1):.0f}%)" for s in slowest[:3])
        return shown + (f" and {len(slowest) - 3} more" if len(slowest) > 3 else "")
