"""The control plane's one periodic message: what the ranks tell each other while they train.

The stop agreement's flags (steadfast/loop/agreement.py), the metrics windows (steadfast/telemetry/metrics.py)
and the snapshot cadence's timings (steadfast/loop/memory_cadence.py) have no collective of their own.
A collective costs about the same whatever it carries: on Gloo a few hundred microseconds of CPU per
rank, in the wake-ups of its threads (bench/step_cost.py), so what the library costs per step is how
many it makes. Every `every` steps (`due`) the message in flight is read, each part getting its
answer, and the next one is started: one all-reduce (a sum) of one CPU tensor on the control plane
(steadfast/distributed/comm.py), pipelined, so it overlaps the steps until the next exchange instead of adding
its latency to one. A rank alone starts none: the sums are its own numbers, read at the next exchange
as a message's answer is. Parts post numbers for the next message, directly or as riders asked at every
send; every rank posts the same parts in the same order, so the message has the same layout on
every rank: a post's `shared` numbers are summed over the ranks, its `own` numbers go in this rank's
row and every rank reads every rank's rows.

The interval: `every_n_steps`, or automatic: the largest power of two (at most MAX_EVERY) whose steps
take at most CONTROL_INTERVAL_S of rank 0's time per step. Every message carries rank 0's time per
step since the one before, so every rank picks the same interval at the same step: every step until
the second message's answer, a few steps into the attempt, or while a part still measures (`hold`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from .comm import Comm, Pending

# automatic interval: the ranks exchange about this often (a stop waits up to two). A message costs the
# training about 0.3-0.8 ms on the 2-core machine of the benchmarks (starting a Gloo collective wakes its
# threads; bench/step_cost.py): under 0.2% of this interval
CONTROL_INTERVAL_S = 0.5
MAX_EVERY = 1024

Reply = Callable[[List[float], List[List[float]]], None]  # (the shared sums, every rank's own numbers)
Rider = Callable[[int, bool], None]  # (the step, at once): posts what is ready, or everything when at once


@dataclass
class _Post:
    shared: List[float]
    own: List[float]
    reply: Reply


class Exchange:
    def __init__(self, comm: Comm, every_n_steps: Optional[int]) -> None:
        self.comm, self.every = comm, max(1, int(every_n_steps or 1))
        self.auto = every_n_steps is None  # `every` follows rank 0's time per step (retune)
        self._riders: List[Rider] = []
        self._holds: List[Callable[[], bool]] = []
        self._posted: List[_Post] = []
        # the message in flight: its posts, and the collective's answer (alone: the numbers themselves)
        self._flying: Optional[Tuple[List[_Post], Union[Pending, List[float]]]] = None
        self.sent_at = -1  # the step at which the message in flight was started
        self._paced: Optional[Tuple[int, float]] = None  # auto, rank 0: (step, clock) at the last send
        self.step = -1  # the step of the latest send or receive: where an answer read now takes effect

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def next_due(self, step: int) -> int:
        """The first step after `step` at which the message is due (at the interval now in force)."""
        return step - step % self.every + self.every

    def ride(self, rider: Rider) -> None:
        """Ask `rider` for its posts at every send, after the parts that post directly."""
        self._riders.append(rider)

    def hold(self, holding: Callable[[], bool]) -> None:
        """While `holding()` is true (the same on every rank) the automatic interval stays at every step:
        a part that still measures (the snapshot cadence's first interval) has its answers at once."""
        self._holds.append(holding)

    def post(self, shared: Sequence[float], own: Sequence[float], reply: Reply) -> None:
        """Numbers for the next message, and what to call with the answer when it is read."""
        self._posted.append(_Post(list(shared), list(own), reply))

    def send(self, step: int, at_once: bool = False) -> None:
        """Read the message in flight, then start the next one with what is posted (the riders asked now)."""
        self.receive(step)
        if self.auto:
            self._pace(step, at_once)
        for rider in self._riders:
            rider(step, at_once)
        posts, self._posted = self._posted, []
        if not posts:  # the same on every rank: nothing to send
            return
        shared = [v for p in posts for v in p.shared]
        own = [v for p in posts for v in p.own]
        ws, rank = self.comm.world_size, self.comm.rank
        values = shared + [0.0] * (ws * len(own))
        start = len(shared) + rank * len(own)
        values[start : start + len(own)] = own
        if ws == 1:  # alone, the sums are this rank's numbers (floats, as an all-reduce's answer): no collective
            self._flying = posts, [float(v) for v in values]
        else:
            self._flying = posts, self.comm.start_sum(torch.tensor(values, dtype=torch.float64))
        self.sent_at = step

    def _pace(self, step: int, at_once: bool) -> None:
        """Rank 0's seconds per step since the last send, in this message (not across an epoch's end or a
        stop: validation and saves are not steps); its answer sets the interval."""
        now, seconds = time.perf_counter(), 0.0
        if self.comm.rank == 0 and self._paced is not None and step > self._paced[0] and not at_once:
            seconds = (now - self._paced[1]) / (step - self._paced[0])
        self._paced = None if at_once else (step, now)
        self.post([seconds], [], lambda shared, own: self.retune(shared[0]))

    def receive(self, step: int) -> None:
        """The message in flight, waited for, each part given its answer (nothing when none is in flight)."""
        self.step = step
        if self._flying is None:
            return
        posts, answer = self._flying
        self._flying = None
        values: List[float] = answer if isinstance(answer, list) else answer.wait().tolist()
        n_shared = sum(len(p.shared) for p in posts)
        n_own = sum(len(p.own) for p in posts)
        rows = [values[n_shared + r * n_own : n_shared + (r + 1) * n_own] for r in range(self.comm.world_size)]
        at_shared = at_own = 0
        for p in posts:
            p.reply(values[at_shared : at_shared + len(p.shared)], [row[at_own : at_own + len(p.own)] for row in rows])
            at_shared, at_own = at_shared + len(p.shared), at_own + len(p.own)

    def flush(self, step: int) -> None:
        """Everything at once: the message in flight, then all that is posted (an epoch's end, a stop, the end)."""
        self.send(step, at_once=True)
        self.receive(step)

    def retune(self, step_seconds: Optional[float]) -> None:
        """auto: the interval for rank 0's time per step (the same on every rank: call it where they all have it)."""
        if not self.auto or not step_seconds:
            return
        every = 1
        while every * 2 * step_seconds <= CONTROL_INTERVAL_S and every * 2 <= MAX_EVERY and not self._held():
            every *= 2
        self.every = every

    def _held(self) -> bool:
        return any(holding() for holding in self._holds)
