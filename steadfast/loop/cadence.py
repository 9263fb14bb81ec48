"""When to save: the checkpoint group's cadence (epochs, steps, seconds, or `auto`), decided here.

Steps and epochs are the same on every rank, so those decisions need no agreement. Time is not:
rank 0's clock decides, and its "a save is due" flag travels with the stop agreement (one
all-reduce), so every rank saves at the same step.

`checkpoint.every_n_seconds=auto` chooses the interval by Young/Daly's rule, T = sqrt(2 C M), from
the measured cost C of a save and the mean time between failures M observed in this run so far
(its wall time over its failures plus one, so a run that has not failed yet gets a long interval
that shortens when failures come), never below FLOOR_S nor below FLOOR_SAVES save costs. Until
a save of this run has been measured (its events record each one's cost), the first save comes
after FLOOR_S: assuming a cost instead could choose an interval longer than the time between
failures, and a run that fails that often would then never commit anything.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

from ..contract import events
from ..contract.events import Event

FLOOR_S = 5.0  # auto: never checkpoint more often than this
FLOOR_SAVES = 20  # auto: nor spend more than 1/20 of the time saving
AUTO = "auto"


def young_daly(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time (Young 1974, Daly 2006), with the floors."""
    return max(FLOOR_S, FLOOR_SAVES * save_s, math.sqrt(2.0 * max(save_s, 1e-3) * max(mtbf_s, 1.0)))


def history(run_dir: Path) -> Tuple[float, int, Optional[float]]:
    """The run's wall time before this launch, its failures so far and the cost of its newest save,
    if any, read from its events (what `auto` starts from when a run is launched again)."""
    recorded = events.records(run_dir, kinds=(Event.LAUNCH, Event.ATTEMPT_STARTED, Event.PREEMPTED, Event.CHECKPOINT_SAVED))
    launches = [r.time for r in recorded if isinstance(r, events.Launch)]
    attempts = sum(1 for r in recorded if isinstance(r, events.AttemptStarted))
    stops = sum(1 for r in recorded if isinstance(r, events.Preempted))
    costs = [r.seconds for r in recorded if isinstance(r, events.CheckpointSaved) and r.seconds is not None and r.seconds >= 0]
    return (
        (max(0.0, time.time() - launches[0]) if launches else 0.0),
        max(0, attempts - stops - len(launches) + 1),
        float(costs[-1]) if costs else None,
    )


class Cadence:
    def __init__(
        self,
        every_n_epochs: Optional[int],
        every_n_steps: Optional[int],
        every_n_seconds: Union[float, str, None],
        run_seconds: float = 0.0,
        failures: int = 0,
        clock: Callable[[], float] = time.monotonic,
        on_interval: Optional[Callable[..., None]] = None,
        save_cost: Optional[float] = None,
    ) -> None:
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.auto = every_n_seconds == AUTO
        self.seconds: Optional[float] = None if every_n_seconds in (None, AUTO) else float(every_n_seconds)
        self.clock = clock
        self.on_interval = on_interval  # records each interval `auto` chooses
        self._run_seconds, self._failures = run_seconds, failures  # this run before this launch
        self._started = clock()
        self.last_save = self._started
        self.save_cost: Optional[float] = save_cost  # seconds, the last save's (this launch's, or an earlier one's)
        self._measured: Optional[float] = None  # auto: the save cost the interval was last chosen from
        if self.auto:
            self.seconds = young_daly(save_cost, self.mtbf()) if save_cost is not None else FLOOR_S

    @property
    def timed(self) -> bool:
        return self.seconds is not None

    def mtbf(self) -> float:
        return (self._run_seconds + self.clock() - self._started) / (self._failures + 1)

    def step_due(self, step: int) -> bool:
        return bool(self.every_n_steps and step % self.every_n_steps == 0)

    def next_step_due(self, step: int) -> Optional[int]:
        """The first step after `step` that checkpoint.every_n_steps saves at (None: no step cadence)."""
        return step - step % self.every_n_steps + self.every_n_steps if self.every_n_steps else None

    def epoch_due(self, epochs_completed: int) -> bool:
        return bool(self.every_n_epochs and epochs_completed % self.every_n_epochs == 0)

    def time_due(self) -> bool:
        """Rank 0's view: the interval has passed since the last save (agreed with the other ranks)."""
        return self.seconds is not None and self.clock() - self.last_save >= self.seconds

    def saved(self, seconds: float) -> None:
        """A save has just been committed (or, asynchronously, started); it took `seconds` of training time."""
        self.last_save = self.clock()
        self.save_cost = seconds
        if self.auto:
            interval = young_daly(seconds, self.mtbf())
            changed = self.seconds is None or abs(interval - self.seconds) > 0.1 * self.seconds
            if self.on_interval is not None and (self._measured is None or changed):
                self.on_interval(
                    seconds=round(interval, 3),
                    save_seconds=round(seconds, 4),
                    mtbf_seconds=round(self.mtbf(), 1),
                    failures=self._failures,
                    how="young_daly",
                )
            self.seconds, self._measured = interval, seconds
