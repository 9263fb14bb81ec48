"""A step boundary: what is due once an optimizer step ends, and the steps at which nothing is.

Each part says what it has to do at a step and the next step at which it may have more than
counting to do: the metrics window (steadfast/telemetry/metrics.py), the control plane's message and what
rides it (steadfast/distributed/exchange.py: a stop, a save by time, an asynchronous save's commit, the
intervals' changes, what the ranks' health guard agreed), the checkpoint cadence by steps, a step
fault, the snapshot cadence, a fingerprint of the replicas. Before the first such step a boundary
only counts: the loss into the window and into the anomaly watch, the step's local time, the
display's clock and the heartbeat's count (the library's whole per-step cost on most steps,
bench/probes/run_step_cost.py), and closes the metrics windows that fall before it (every
log_every_n_steps: a window's close is `due`'s work for the telemetry, without asking every other
part). What is due comes back as a value; `steadfast.Run` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch

from ..checkpoint.tracked import Checkpointer
from ..contract.heartbeat import Heartbeat
from ..faults import FaultInjector
from ..telemetry.metrics import Loss, Telemetry
from .agreement import StopAgreement
from .cadence import Cadence
from .memory_cadence import MemoryCadence


@dataclass(frozen=True)
class Due:
    """What a step boundary asks of the run, the same on every rank."""

    save: bool = False  # commit this step (the step cadence, or the ranks agreed on rank 0's clock)
    stop: Optional[int] = None  # the signal every rank agreed to stop on
    over_memory: Optional[Tuple[int, float]] = None  # (rank, MB): a rank's peak memory passed max_rss_mb


class Guard(Protocol):
    """What a step boundary asks of the ranks' health guard (steadfast/health/guard.py)."""

    def observe(self, step: int, loss: Loss, grad_norm: Loss) -> None: ...

    def at_step(self, step: int) -> None: ...

    def take(self) -> Optional[object]: ...

    def next_due(self, step: int) -> Optional[int]: ...

    @property
    def found(self) -> Optional[object]: ...  # agreed, not yet taken


class StepBoundary:
    def __init__(
        self,
        telemetry: Telemetry,
        agreement: StopAgreement,
        cadence: Cadence,
        faults: FaultInjector,
        checkpointer: Checkpointer,
        memory: Optional[MemoryCadence],
        heartbeat: Optional[Heartbeat],
        time_due: Callable[[], bool],
    ) -> None:
        self.telemetry, self.agreement, self.cadence, self.faults = telemetry, agreement, cadence, faults
        self.checkpointer, self.memory, self.heartbeat, self.time_due = checkpointer, memory, heartbeat, time_due
        if memory is not None and heartbeat is not None:
            # the file never behind a snapshot: a rank killed outright is named at a step its group resumes from
            memory.before_copy = heartbeat.flush
        self.guard: Optional[Guard] = None  # the ranks' health guard (steadfast/health/), when anything is watched
        # what the run does about a finding (steadfast/health/loop.py): True when it went back to an earlier step
        self.act: Callable[[Any], bool] = lambda finding: False
        self.before_window: Callable[[], None] = lambda: None  # what the run gives a window before it closes (the lr)
        self.host = not telemetry.cuda  # a run on the CPU: its losses are on the host (read without asking)
        self.quiet_until = 0  # the steps before this one only count; 0: the next step is a whole boundary
        self.window_at = 0  # the next step at which a metrics window closes (before quiet_until: in `quiet`)

    def quiet(self, step: int, epoch: int, loss: Loss, grad_norm: Loss = None) -> bool:
        """Most steps: when nothing but counting is due at `step`, count it and say so."""
        if step >= self.quiet_until:
            return False
        if step == self.window_at:
            return self._window(step, epoch, loss, grad_norm)
        if loss.__class__ is torch.Tensor and self.host:  # _on_host's work, inline: this runs cold on most steps
            number: Any = loss.tolist()  # a 0-d tensor's number
            loss = number if number.__class__ is float else loss.item()
        elif loss.__class__ is not float:
            loss = _on_host(loss)
        if grad_norm is not None:
            grad_norm = _on_host(grad_norm)
        self.telemetry.quiet_step(step, epoch, loss)
        if self.guard is not None:
            self.guard.observe(step, loss, grad_norm)
        if self.heartbeat is not None:
            self.heartbeat.count(step)  # in memory: the heartbeat's thread writes it
        return True

    def due(self, step: int, epoch: int, loss: Loss, grad_norm: Loss = None) -> Due:
        """A whole boundary: every part's work at `step`, what the run is to do next as the answer.
        The heartbeat's file says `step` before a step fault fires (the injector writes the count: the
        watchdog's view of a hang, the step the launcher names a killed rank at)."""
        loss, grad_norm = _on_host(loss), _on_host(grad_norm)
        if step % self.telemetry.every == 0:
            self.before_window()
        self.telemetry.add_loss(loss)
        if self.guard is not None:
            self.guard.observe(step, loss, grad_norm)
        over = self.telemetry.after_step(step, epoch)
        if self.heartbeat is not None:
            self.heartbeat.count(step)
        self.faults.after_step(step)
        if self.guard is not None:
            self.guard.at_step(step)
        manager = self.checkpointer.manager
        control = self.agreement.at_step(step, self.time_due, busy=manager.busy())
        written = manager.written_step()
        if written is not None and control.since > written and not control.busy:
            self.checkpointer.commit_written()  # every rank has written its files of the asynchronous save: commit it
        found = self.guard.take() if self.guard is not None else None
        if found is not None and self.act(found):  # this step is no longer trained: only a stop agreed now is due
            return Due(False, control.stop, over)
        return Due(self.cadence.step_due(step) or control.save_due, control.stop, over)

    def _window(self, step: int, epoch: int, loss: Loss, grad_norm: Loss) -> bool:
        """A step before `quiet_until` at which a metrics window closes: what `due` and `after` do at it,
        nothing else being due (False, a whole boundary, while what an answer read out of turn brought waits
        to be acted on: a rank's peak memory, a finding of the ranks' health)."""
        telemetry, guard = self.telemetry, self.guard
        if telemetry.over_due or (guard is not None and guard.found is not None):
            return False
        loss, grad_norm = _on_host(loss), _on_host(grad_norm)
        self.before_window()
        telemetry.add_loss(loss)
        if guard is not None:
            guard.observe(step, loss, grad_norm)
        telemetry.after_step(step, epoch)  # None: no peak memory to act on (over_due)
        if self.heartbeat is not None:
            self.heartbeat.count(step)
        self.window_at = step + telemetry.every  # telemetry.next_due: a window's step, no peak memory to act on
        telemetry.timer.mark()
        return True

    def after(self, step: int) -> None:
        """The end of a whole boundary (after a save it asked for): this step's snapshot if one is due,
        the next step with anything to do, the next step's local time from now."""
        if self.memory is not None and not self.memory.at_step(step):
            self.memory = self.checkpointer.memory = None  # off on every rank from now on
        self.quiet_until, self.window_at = self._next_due(step), self.telemetry.next_due(step)
        self.telemetry.timer.mark()  # the next step's local work begins (steadfast/telemetry/_stragglers.py)

    def reset(self) -> None:
        """The next step is a whole boundary (an epoch begins: its end exchanged and may have saved)."""
        self.quiet_until = 0

    def _next_due(self, step: int) -> int:
        # the telemetry's windows close in `quiet` (window_at); a peak memory to act on needs a whole boundary
        due: List[Optional[int]] = [step + 1 if self.telemetry.over_due else None, self.agreement.exchange.next_due(step)]
        due += [self.cadence.next_step_due(step), self.faults.next_due(step)]
        if self.memory is not None:
            due.append(self.memory.next_due(step))
        if self.guard is not None:
            due.append(self.guard.next_due(step))
        return min(d for d in due if d is not None)


def _on_host(value: Loss) -> Loss:
    """A CPU tensor's number, read once for the metrics window and the anomaly watch alike; any other
    value as it is (a device's tensor is never read at a step). A one-number tensor's `.tolist()` is
    what `.item()` reads without its dispatch: a microsecond and more less, run cold after a step's
    compute (bench/NOTES.md); another shape goes to `.item()` (a number, or its error)."""
    if isinstance(value, torch.Tensor) and value.is_cpu:
        number: Any = value.tolist()
        return number if number.__class__ is float else value.item()
    return value
