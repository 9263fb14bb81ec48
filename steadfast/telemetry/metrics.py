"""What a person sees of the loop: the loss and memory of every rank in metrics.jsonl (and the sinks
of logger.sinks: TensorBoard, CSV, MLflow), the progress display; and the memory guard.

The loss is summed on the device as the steps go (no host sync per step). Every
`log_every_n_steps` steps a window closes: its loss sum and count, and this rank's peak memory and local time per step (steadfast/telemetry/_stragglers.py) in its own slot. Windows travel
to the other ranks in the control plane's periodic message (steadfast/distributed/exchange.py: one all-reduce of
CPU numbers on a process group of its own, about every half second by default; a Telemetry
given no exchange sends one per window), so every rank sees the same numbers and takes the same
decisions: the memory guard, the stragglers named. A
window's row is written when the exchange that carried it is read, with the window's step and time:
steps later, never holding one up. On CUDA a window's loss sum is copied to the host when it closes
and sent from the first exchange a window's steps later, when the copy has long landed: the host
never waits for the device. The epoch's end, a stop and the end of the run send and read what is
left at once.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..contract import events
from ..contract.events import Event
from ..distributed.comm import Comm
from ..distributed.exchange import Exchange
from ._progress import ProgressDisplay
from ._sink import Sinks
from ._stragglers import StepTimer, StragglerRule
from .records import RunRecord

log = logging.getLogger("steadfast")


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


@dataclass(slots=True)
class _Window:
    """One metrics window, closed: its numbers until the exchange that carries them is read."""

    step: Optional[int]  # None: the rest of an epoch, reduced for its mean only (no row)
    closed_at: int  # the step at which it closed
    epoch: int
    time: float
    wall: float
    lr: Optional[float]
    loss: float  # this rank's loss sum in the window, the part summed on the host (CPU losses)
    device_loss: Optional[torch.Tensor]  # and the part summed on the device (CUDA losses), not yet read
    count: int
    shared: List[float]  # summed over the ranks: [loss sum, count]
    own: List[float]  # this rank's: [peak memory MB, local seconds per step(, CUDA peak MB)]
    host: Optional[torch.Tensor] = None  # CUDA: the loss sum, copied to (pinned) host memory without waiting
    landed: Any = None  # CUDA: an event recorded after that copy


SHARED = 2  # numbers of a window summed over the ranks

Loss = Union[torch.Tensor, float, None]  # what a step reports: a tensor on any device, a number, or nothing


class Telemetry:
    def __init__(
        self,
        comm: Comm,
        record: RunRecord,
        progress_mode: str,
        progress_every_s: float,
        log_every_n_steps: int,
        started: float,
        restarts: int,
        sinks: Optional[Sinks] = None,
        max_rss_mb: Optional[float] = None,
        straggler_margin: Optional[float] = None,
        straggler_windows: int = 1,
        on_boundary: Optional[Callable[[], None]] = None,
        exchange: Optional[Exchange] = None,
    ) -> None:
        self.comm, self.record, self.every = comm, record, max(1, int(log_every_n_steps))
        self.started, self.restarts, self.max_rss_mb = started, restarts, max_rss_mb
        self.cuda = comm.device.type == "cuda"
        self._drives = exchange is None  # alone: an exchange of its own, one message per window
        self.exchange = Exchange(comm, self.every) if exchange is None else exchange
        self.exchange.ride(self._post)
        self._total = 0.0  # this window's CPU losses, summed as they come (reading a CPU tensor waits for nothing)
        self._losses: List[torch.Tensor] = []  # its device losses, detached: summed on the device when it closes
        self._count = 0
        self._closed: List[_Window] = []  # not yet sent
        self._sent: List[_Window] = []  # sent, their answer not yet read
        self._last = 0  # the last step seen
        self._over: Optional[Tuple[int, float]] = None  # (rank, MB) over max_rss_mb, read but not yet acted on
        self._epoch = [0.0, 0]  # global (sum, batches) of the current epoch's reduced windows
        self.last_loss: Optional[float] = None  # the mean loss of the last reduced window (all ranks)
        self.display = ProgressDisplay(progress_mode, progress_every_s, 0, 0, enabled=comm.rank == 0)
        self._shown = self.display.mode != "none"  # the display has work at a step (rank 0, a progress mode)
        self.sinks = sinks if sinks is not None else Sinks()
        if self.sinks:
            record.after = self.sinks.write  # on the rows' thread, after metrics.jsonl has the row
        self.lr: Optional[float] = None
        self.by_epochs = True  # rows say their epoch (a loop of steps, plan(n, 0), has none)
        self.timer = StepTimer(self.cuda, on_boundary)  # this rank's local time per step, its mean in every window
        self.stragglers = StragglerRule(straggler_margin, straggler_windows)

    def plan(self, total_steps: int, max_epochs: int) -> None:
        """The loop's bounds: total steps (0: unknown) and epochs (0: a loop of steps, run.steps, whose
        progress line and metrics rows have no epoch)."""
        self.display.total, self.display.max_epochs = total_steps, max_epochs
        self.by_epochs = max_epochs > 0

    def add_loss(self, loss: Loss) -> None:
        if loss.__class__ is float:  # a CPU loss the step boundary read
            self._total += loss
            self._count += 1
            return
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            self._total += float(loss)
        elif loss.is_cpu:
            self._total += loss.item()  # waits for nothing on the CPU (and, unlike float(), warns of no graph)
        else:  # no op but an append a step: the window's device sum is one stack and sum when it closes
            self._losses.append(loss.detach())
        self._count += 1

    def _device_sum(self) -> Optional[torch.Tensor]:
        """The window's device losses so far, summed on the device (None when it has none)."""
        return torch.stack(self._losses).sum(dtype=torch.float32) if self._losses else None

    def next_due(self, step: int) -> int:
        """The first step after `step` at which `after_step` has more to do than `quiet_step`: a window
        closes, or a rank's peak memory read at this step's exchange is to be acted on."""
        return step + 1 if self._over is not None else step - step % self.every + self.every

    @property
    def over_due(self) -> bool:
        """A rank's peak memory passed max_rss_mb: the next after_step returns it (to act on)."""
        return self._over is not None

    def quiet_step(self, step: int, epoch: int, loss: Loss) -> None:
        """A step before `next_due`: its loss, its local time (the step's boundary too), the display."""
        if loss.__class__ is float:  # a CPU loss, read once by the step boundary: add_loss's work, inline
            self._total += loss
            self._count += 1
        elif loss is not None:
            self.add_loss(loss)
        timer = self.timer
        if timer._pair is None:  # StepTimer.boundary's work, inline (a call costs a microsecond, cold): no CUDA events
            now = time.perf_counter()
            arrival = timer._arrival
            timer._sum += now - timer._mark if arrival is None else arrival - timer._mark + timer._forward
            timer._steps += 1
            timer._arrival, timer._forward = None, 0.0
            timer._mark = now
            if timer.on_mark is not None:
                timer.on_mark()
        else:
            timer.boundary()
        self._last = step
        if self._shown:
            self.display.update(step, epoch)

    def after_step(self, step: int, epoch: int) -> Optional[Tuple[int, float]]:
        """Per step: its local time into the window, the display; every log_every_n_steps the window
        closes (and, alone, goes out). Returns (rank, MB) when a rank's peak memory passed max_rss_mb
        (the same answer on every rank, at the first step after the exchange that brought it), else None."""
        self.timer.step()
        self._last = step
        if step % self.every:
            if self._shown:
                self.display.update(step, epoch)
            return self._pop_over()
        self._closed.append(self._close(step, epoch))
        if self._drives:
            self.exchange.send(step)
        over = self._pop_over()
        if self._shown:
            self.display.update(step, epoch, self.last_loss)
        return over

    def _close(self, step: Optional[int], epoch: int) -> _Window:
        """This window's numbers, on the host (the rest of an epoch, `step` None, leaves its steps'
        local time to the next window). A loss sum on the device is copied without waiting."""
        # [0]: this rank's peak memory so far, read when the window is sent (once a message, not a window)
        own = [0.0, self.timer.window() if step is not None else 0.0]
        if self.cuda:
            own.append(torch.cuda.max_memory_allocated(self.comm.device) / 2**20)
        total, device, count = self._total, self._device_sum() if self._losses else None, self._count
        self._total, self._losses, self._count = 0.0, [], 0
        host, landed = None, None
        if device is not None:
            host = torch.empty((), dtype=torch.float64, pin_memory=device.device.type == "cuda")
            host.copy_(device.double(), non_blocking=True)
            landed = torch.cuda.Event() if device.device.type == "cuda" else None  # type: ignore[no-untyped-call]
            if landed is not None:
                landed.record()
        closed_at = self._last if step is None else step
        now = time.time()
        return _Window(
            step,
            closed_at,
            epoch,
            now,
            now - self.started,
            self.lr,
            total,
            device,
            count,
            [total, float(count)],
            own,
            host,
            landed,
        )

    def _post(self, step: int, at_once: bool) -> None:
        """The exchange's rider: the closed windows whose numbers are on the host go out (on CUDA those
        closed a window's steps ago or more, their copy long landed; at once: all of them)."""
        lag = self.every if self.cuda and not at_once else 0
        ready = [w for w in self._closed if w.closed_at + lag <= step]
        if not ready:
            return
        del self._closed[: len(ready)]
        rss = peak_rss_mb()  # a peak: the same or more than when the windows closed
        for w in ready:
            w.own[0] = rss
            if w.host is not None:
                if w.landed is not None and not w.landed.query():  # only when sent at once: an epoch's end, a stop, the end
                    w.landed.synchronize()
                w.shared[0] += float(w.host)  # host memory
        self._sent.extend(ready)
        n = len(ready[0].own)
        self.exchange.post(
            [v for w in ready for v in w.shared],
            [v for w in ready for v in w.own],
            lambda shared, own: self._read(ready, shared, [[row[i : i + n] for i in range(0, len(row), n)] for row in own]),
        )

    def _read(self, windows: List[_Window], shared: List[float], own: List[List[List[float]]]) -> None:
        """The answer for `windows`: each one's sums and every rank's numbers (own[rank][window])."""
        del self._sent[: len(windows)]
        with self.record.held():
            for i, window in enumerate(windows):
                self._reduced(window, shared[SHARED * i : SHARED * (i + 1)], [rows[i] for rows in own])

    def _pop_over(self) -> Optional[Tuple[int, float]]:
        over, self._over = self._over, None
        return over

    def _reduced(self, window: _Window, sums: List[float], ranks: List[List[float]]) -> None:
        """A window's numbers over the ranks: into the epoch's sums, its metrics row, and (rank, MB)
        kept for the next after_step if a rank's peak memory passed max_rss_mb."""
        total, batches = sums[0], int(sums[1])
        self._epoch[0] += total
        self._epoch[1] += batches
        mean = total / batches if batches else None
        if mean is not None:
            self.last_loss = mean
        if self.max_rss_mb and self._over is None:
            rss = [round(r[0], 1) for r in ranks]
            if max(rss) > self.max_rss_mb:
                self._over = rss.index(max(rss)), max(rss)
        if window.step is None:
            return
        if self.stragglers.on and len(ranks) > 1:  # off, or alone: nobody to name (StragglerRule.update)
            self._stragglers([r[1] for r in ranks], window.step)
        by_epochs = self.by_epochs
        self.record.later(lambda: self._row(window, mean, ranks, by_epochs))

    def _row(self, window: _Window, mean: Optional[float], ranks: List[List[float]], by_epochs: bool) -> Dict[str, Any]:
        """A window's metrics row (built on the rows' thread: records.py)."""
        rss = [round(r[0], 1) for r in ranks]
        row: Dict[str, Any] = {"time": round(window.time, 3), "step": window.step}
        if by_epochs:
            row["epoch"] = window.epoch
        if mean is not None:
            row["loss"] = round(mean, 6)
        if window.lr is not None:
            row["lr"] = window.lr
        row.update(
            wall=round(window.wall, 3),
            restart=self.restarts,
            rss_mb=rss[self.comm.rank],
            rss_mb_per_rank=rss,
            rss_mb_max=max(rss),
            local_ms_per_rank=[round(1000 * r[1], 3) for r in ranks],
        )
        if self.cuda:
            row["cuda_mb_per_rank"] = [round(r[2], 1) for r in ranks]
        return row

    def _stragglers(self, local: List[float], step: int) -> None:
        """One window's local times per step through the naming rule (every rank, the same numbers):
        the slow rank records its own `straggler` event (its host and pid), rank 0 says so once."""
        rule = self.stragglers
        named, recovered = rule.update(local)
        if not (named or recovered or rule.named):
            return  # nothing to say, nothing shown (the progress line's `slow` was emptied when the last recovered)
        for s, back in [(s, False) for s in named] + [(s, True) for s in recovered]:
            if s.rank == self.comm.rank:
                events.append(self.record.run_dir, Event.STRAGGLER, restart=self.restarts, **s.fields(step, rule.windows, back))
            if self.comm.rank == 0:
                log.warning(
                    "%s rank %d: its local work (loading the batch, the forward) took %.1f ms per step, the other "
                    "ranks' median %.1f ms (%+.0f%%), %d logging window(s) in a row to step %d",
                    "no longer slower:" if back else "straggler:",
                    s.rank,
                    1000 * s.local_s,
                    1000 * s.median_s,
                    100 * (s.ratio - 1),
                    rule.windows,
                    step,
                )
        self.display.slow = rule.describe()

    def end_epoch(self) -> Optional[float]:
        """The epoch's mean loss over every rank and batch (collective: sends and reads what is left at
        once); starts the next epoch's count."""
        self._closed.append(self._close(None, 0))
        self.exchange.flush(self._last)
        total, batches = self._epoch
        self._epoch = [0.0, 0]
        return total / batches if batches else None

    def state_dict(self) -> Dict[str, Any]:
        """This rank's loss not yet logged and the epoch's sums: checkpointed per rank, so a resumed
        run's epoch losses are the uninterrupted run's. The windows not yet read (sent or not) are not
        waited for: their sums are saved with the loss not yet logged, and a resumed run reduces them
        with its first window."""
        total, count = self._total, self._count
        device = [self._device_sum()]
        for unread in (*self._sent, *self._closed):
            if unread.step is not None and unread.count:
                total += unread.loss
                device.append(unread.device_loss)
                count += unread.count
        saved = torch.tensor(total, dtype=torch.float32)
        for part in device:
            if part is not None:
                saved += part.detach().cpu()
        return {"window": saved, "count": count, "epoch_sum": self._epoch[0], "epoch_batches": self._epoch[1]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._count = int(state["count"])
        self._total, self._losses = (float(state["window"]) if self._count else 0.0), []
        self._epoch = [float(state["epoch_sum"]), int(state["epoch_batches"])]

    def metrics(self, **row: Any) -> None:
        """A row of metrics.jsonl (rank 0), and the same row to the sinks of logger.sinks (both on the
        rows' thread, in the order given: records.py)."""
        self.record.metrics(**row)

    def close(self, sinks: bool = False) -> None:
        """The last windows' rows (every rank, at the same step), unless an error is unwinding: then a
        peer may be gone and what is in flight is left. Every row read is in metrics.jsonl when it returns. `sinks`: the sinks' end too (the attempt's end,
        after run.finish gave them the result)."""
        if sys.exc_info()[0] is None and (self._closed or self._sent):
            self.exchange.flush(self._last)
        self._closed, self._sent = [], []
        self.display.close()
        self.record.flush()  # every row in metrics.jsonl (and given to the sinks, before their end)
        if sinks:
            self.sinks.close()
