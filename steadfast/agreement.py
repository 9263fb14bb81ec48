"""Every rank stops at the same step: the stop agreement, off the training's critical path.

A stop request (SIGTERM, SIGINT, SIGHUP) only sets a flag in the rank that got it. Every
`every_n_steps` steps the ranks exchange their flags, with rank 0's "a timed save is due", in one
all-reduce of two floats. It is pipelined: started at one check and read at the next, so it
overlaps the steps in between instead of adding its latency to one; every rank reads the same
result at the same step, so all of them stop (and save) at the same step. At an epoch's end it is
waited for at once (a stop may have come during validation or a save).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from .comm import Comm
from .contract.stop import signal_name, stop_requested

log = logging.getLogger(__name__)


@dataclass
class Control:
    stop: Optional[int] = None  # the stop request's signal number, agreed
    save_due: bool = False  # rank 0's clock says a timed checkpoint is due
    busy: bool = False  # some rank was still writing its files of an asynchronous sharded save
    since: int = -1  # the step at which the ranks sent what this agrees


CHECK_INTERVAL_S = 0.05  # automatic every_n_steps: the ranks agree about this often
MAX_CHECK_EVERY = 200


class StopAgreement:
    def __init__(self, comm: Comm, every_n_steps: Optional[int]) -> None:
        self.comm, self.every = comm, max(1, int(every_n_steps or 1))
        self.auto = every_n_steps is None  # every_n_steps follows the time per step (retune)
        self._pending: Any = None  # the all-reduce in flight
        self._sent_at = -1  # the step at which it was started
        self._announced = False

    def _flags(self, save_due: bool, busy: bool = False) -> List[float]:
        local = stop_requested()
        if local is not None and not self._announced:
            self._announced = True
            log.warning("%s received: stopping at a step boundary agreed with the other ranks", signal_name(local))
        return [float(local or 0), 1.0 if save_due else 0.0, 1.0 if busy else 0.0]

    def at_step(self, step: int, save_due: Callable[[], bool] = lambda: False, busy: bool = False) -> Control:
        """At a step boundary: acts on what every rank reported at the previous check, starts the next.
        `save_due` is rank 0's clock; it is not asked when the agreed answer already saves now. `busy`:
        this rank still writes an asynchronous save's files (committed once no rank is)."""
        if step % self.every:
            return Control()
        agreed = self._pending.wait() if self._pending is not None else [0.0, 0.0, 0.0]
        control = Control(int(agreed[0]) or None, agreed[1] > 0, agreed[2] > 0, self._sent_at)
        self._pending = self.comm.start_max_each(self._flags(not control.save_due and save_due(), busy))
        self._sent_at = step
        return control

    def retune(self, step_seconds: Optional[float]) -> None:
        """auto: agree about every CHECK_INTERVAL_S, from rank 0's time per step, which the log step's
        all-reduce brought to every rank (so every rank picks the same)."""
        if not self.auto or not step_seconds:
            return
        every = 1
        while every * 2 * step_seconds <= CHECK_INTERVAL_S and every * 2 <= MAX_CHECK_EVERY:
            every *= 2
        self.every = every

    def now(self) -> Optional[int]:
        """The same, waited for at once: a stop request any rank has, or None."""
        earlier = self._pending.wait() if self._pending is not None else [0.0, 0.0]
        self._pending = None
        current = self.comm.max_each(self._flags(False))
        return int(max(earlier[0], current[0])) or None

    def drain(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
