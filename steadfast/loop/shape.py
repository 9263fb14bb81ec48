"""The loop's shape: epochs (`run.epochs`) or optimizer steps alone (`run.steps`), its bound, and
where the run stands in the loop's own terms, for the progress line, the messages, the metrics
rows and summary.json. A loop of steps has no epochs to show: `step 153/5000`, not
`epoch 0/0 | step 153/0`, and summary.json says `max_steps`, not `epochs_completed: 0`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, Optional

from ..checkpoint.state import Progress
from ..telemetry.metrics import Telemetry
from .boundary import StepBoundary
from .cadence import Cadence
from .data import RunData

log = logging.getLogger("steadfast")


class LoopShape:
    def __init__(
        self,
        progress: Progress,
        data: RunData,
        telemetry: Telemetry,
        boundary: StepBoundary,
        cadence: Cadence,
        resized: Callable[[], None],
    ) -> None:
        self.progress, self.data, self.telemetry, self.boundary, self.cadence = progress, data, telemetry, boundary, cadence
        self.resized = resized  # records a resume on another world size, when a loop begins (the app's notes given)
        self.max_steps: Optional[int] = None  # run.steps' bound (None: not a loop of run.steps)
        self.epochs_called = False
        self.resumed: Optional[str] = None  # "Resumed from ...", said once the loop's shape is known (announce)

    @property
    def by_steps(self) -> bool:
        """A loop of steps without epochs: run.steps, or nothing that deals data by epochs."""
        return self.max_steps is not None or (not self.data.samplers and not self.epochs_called and self.progress.epoch == 0)

    def where(self) -> str:
        """Where the run stands (numbered as the progress line numbers it)."""
        p = self.progress
        return f"step {p.global_step}" if self.by_steps else f"epoch {p.epoch + 1}, batch {p.batch_in_epoch}"

    def position(self) -> Dict[str, Any]:
        """The loop's part of summary.json: its bound (a loop of steps) or the epochs completed."""
        return {"max_steps": self.max_steps} if self.by_steps else {"epochs_completed": self.progress.epoch}

    def row(self) -> Dict[str, Any]:
        """A metrics row's position: its step, and its epoch in a loop of epochs."""
        p = self.progress
        return {"step": p.global_step} if self.by_steps else {"step": p.global_step, "epoch": p.epoch}

    def announce(self, done: Optional[str] = None) -> None:
        """Say where a resume left the run, in the loop's terms, once they are known (a loop begins, or
        its first step); `done`: the loop's bound is already reached."""
        if self.resumed is not None:
            log.info("%s (%s)", self.resumed, done or self.where())
            self.resumed = None

    def epochs(self, max_epochs: int, end: Callable[[int], None]) -> Iterator[int]:
        """run.epochs: the epochs left, `end(max_epochs)` after each."""
        self.epochs_called = True
        per_epoch = -(-self.data.batches_per_epoch // self.data.accumulate)
        self.telemetry.plan(max_epochs * per_epoch, max_epochs)
        self.resized()
        complete = self.progress.epoch >= max_epochs
        self.announce(f"all {max_epochs} epochs done: already complete, nothing to train" if complete else None)
        while self.progress.epoch < max_epochs:
            self.data.begin_epoch()
            self.begin()
            yield self.progress.epoch
            end(max_epochs)

    def begin(self) -> None:
        """A stretch of steps begins (an epoch, or run.steps): its first step is a whole boundary."""
        self.boundary.reset()
        self.telemetry.timer.mark()

    def steps(self, max_steps: int) -> Iterator[int]:
        """run.steps: checked now; the steps left, each as the number of steps done before it."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"run.steps(max_steps={max_steps!r}): a number of optimizer steps >= 0")
        self.max_steps = max_steps
        self.telemetry.plan(max_steps, 0)
        if self.cadence.every_n_epochs and not (self.cadence.every_n_steps or self.cadence.timed):
            log.warning(
                "checkpoint.every_n_epochs=%d saves at an epoch's end, and run.steps has no epochs: only the run's "
                "end and a stop will save. Use checkpoint=every_n_steps (or checkpoint.every_n_seconds)",
                self.cadence.every_n_epochs,
            )
        self.resized()
        complete = self.progress.global_step >= max_steps
        self.announce(f"all {max_steps} steps done: already complete, nothing to train" if complete else None)
        self.begin()
        return self._steps(max_steps)

    def _steps(self, max_steps: int) -> Iterator[int]:
        p = self.progress
        while p.global_step < max_steps:
            done = p.global_step
            yield done
            if p.global_step == done:
                raise RuntimeError(
                    f"run.steps: the iteration of step {done + 1} ended without run.step(); call run.step(loss) once in "
                    "each, after optimizer.step()"
                )
