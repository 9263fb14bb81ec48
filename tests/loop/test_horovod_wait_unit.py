"""How a Horovod rank waits for its collectives (steadfast/distributed/_horovod.py): it keeps its core
while a step's all-reduce finishes, and sleeps through a long wait. Horovod itself is replaced by its
`poll`, the one call the wait makes (the real one runs in tests/launcher/test_horovod.py)."""

from __future__ import annotations

import time
from typing import Dict, List

from steadfast.distributed import _horovod
from steadfast.distributed._horovod import HorovodComm


class Collectives:
    """Handles that finish at given times (time.monotonic), and what was asked of them."""

    def __init__(self, done_at: Dict[int, float]) -> None:
        self.done_at = done_at
        self.polled_after_done: List[int] = []

    def poll(self, handle: int) -> bool:
        now = time.monotonic()
        if handle in self.polled_after_done:
            raise AssertionError(f"handle {handle} polled again once it was done")
        if now >= self.done_at[handle]:
            self.polled_after_done.append(handle)
            return True
        return False


def comm_over(collectives: Collectives) -> HorovodComm:
    comm = HorovodComm.__new__(HorovodComm)  # without hvd.init: only the wait is under test
    comm.hvd = collectives
    return comm


def test_the_wait_ends_once_every_handle_is_done_and_asks_a_done_one_no_more() -> None:
    start = time.monotonic()
    collectives = Collectives({1: start + 0.02, 2: start, 3: start + 0.05})
    comm_over(collectives)._wait([1, 2, 3])
    assert time.monotonic() >= start + 0.05
    assert sorted(collectives.polled_after_done) == [1, 2, 3]


def test_a_long_wait_stops_spinning() -> None:
    """A step's all-reduce (well under SPIN_S) is waited for by a thread that stays runnable (what that
    is worth: bench/horovod.py); a wait for a slow or stuck peer goes on asleep after SPIN_S, so the
    rank's CPU stays far below the wait's wall time (a thread that spun throughout would use about all
    of it)."""
    wait = 1.5
    assert _horovod.SPIN_S < wait / 5
    start, cpu = time.monotonic(), time.thread_time()
    comm_over(Collectives({1: start + wait}))._wait([1])
    used = time.thread_time() - cpu
    assert used < _horovod.SPIN_S + wait / 3, f"{used:.2f} s of CPU in a {wait} s wait"
