"""Every rank stops at the same step: the stop agreement, off the training's critical path.

A stop request (SIGTERM, SIGINT, SIGHUP) only sets a flag in the rank that got it. At every
exchange of the control plane's periodic message (steadfast/distributed/exchange.py: every `every_n_steps`
steps, by default about every CONTROL_INTERVAL_S) the ranks send their flags, with rank 0's "a timed
save is due" and whether they still write an asynchronous save. It is pipelined: sent at one
exchange and read at the next, so it overlaps the steps in between instead of adding its latency to
one; every rank reads the same result at the same step, so all of them stop (and save) at the same
step. At an epoch's end it is waited for at once (a stop may have come during validation or a save).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional

from ..contract.stop import signal_name, stop_requested
from ..distributed.exchange import Exchange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Control:
    stop: Optional[int] = None  # the stop request's signal number, agreed
    save_due: bool = False  # rank 0's clock says a timed checkpoint is due
    busy: bool = False  # some rank was still writing its files of an asynchronous sharded save
    since: int = -1  # the step at which the ranks sent what this agrees


NOTHING = Control()  # what a step without an exchange returns (no allocation per step)


class StopAgreement:
    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self._agreed: Optional[Control] = None  # the answer read, not yet acted on
        self._announced = False

    def _flags(self) -> List[float]:
        local = stop_requested()
        if local is not None and not self._announced:
            self._announced = True
            log.warning("%s received: stopping at a step boundary agreed with the other ranks", signal_name(local))
        return [float(local or 0)]

    def _send(self, step: int, save_due: bool, busy: bool) -> None:
        def reply(shared: List[float], own: List[List[float]]) -> None:
            signum = int(max(row[0] for row in own))
            self._agreed = Control(signum or None, shared[0] > 0, any(row[1] > 0 for row in own), step)

        self.exchange.post([1.0 if save_due else 0.0], [*self._flags(), 1.0 if busy else 0.0], reply)

    def at_step(self, step: int, save_due: Callable[[], bool] = lambda: False, busy: bool = False) -> Control:
        """At a step boundary: at an exchange, acts on what every rank sent at the previous one and sends
        the next message. `save_due` is rank 0's clock; it is not asked when the agreed answer already
        saves now. `busy`: this rank still writes an asynchronous save's files (committed once no rank is)."""
        if not self.exchange.due(step):
            return NOTHING
        self.exchange.receive(step)
        control, self._agreed = self._agreed or NOTHING, None
        self._send(step, not control.save_due and save_due(), busy)
        self.exchange.send(step)
        return control

    def now(self, step: int) -> Optional[int]:
        """The same, waited for at once: a stop request any rank has, or None."""
        self.exchange.receive(step)
        earlier, self._agreed = self._agreed or NOTHING, None
        self._send(step, False, False)
        self.exchange.flush(step)
        current, self._agreed = self._agreed or NOTHING, None
        return max(earlier.stop or 0, current.stop or 0) or None

    def drain(self, step: int) -> None:
        """Read what is in flight (before a stop or the end: every rank, at the same step)."""
        self.exchange.receive(step)
        self._agreed = None
