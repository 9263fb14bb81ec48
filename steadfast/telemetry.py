"""What a person sees of the loop: the loss and memory of every rank in metrics.jsonl, the progress
display, TensorBoard; and the memory guard.

The loss is summed on the device as the steps go (no host sync per step). Every
`log_every_n_steps` steps one all-reduce carries the loss window, rank 0's time per step and
every rank's peak memory (each rank in its own slot), so every rank sees the same numbers and
takes the same decisions. It is pipelined like the stop agreement: started at one log step and
read at the next, so its latency (a fraction of a millisecond, several on a loaded machine) never
holds up a step; the row of step s is written at step s + log_every_n_steps, with step s's time.
The epoch's end, a stop and the end of the run read what is in flight at once. The same all-reduce
carries every rank's local time per step (steadfast/stragglers.py), in its own slot: every rank
names the same stragglers from the same numbers, with no collective of their own.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from .comm import Comm
from .contract import events
from .contract.events import Event
from .progress import ProgressDisplay
from .records import RunRecord
from .stragglers import StepTimer, StragglerRule

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("steadfast")


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


@dataclass
class _Window:
    """The numbers of one metrics window, their all-reduce in flight."""

    step: Optional[int]  # None: the rest of an epoch, reduced for its mean only (no row)
    epoch: int
    time: float
    wall: float
    lr: Optional[float]
    rss_mb: float  # this rank's, when the window closed
    loss: Optional[torch.Tensor]  # this rank's loss sum and count in the window (for a checkpoint taken meanwhile)
    count: int
    reduced: Any  # comm.Pending: the summed tensor


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
        tensorboard_dir: Any = None,
        max_rss_mb: Optional[float] = None,
        straggler_margin: Optional[float] = None,
        straggler_windows: int = 1,
        on_boundary: Optional[Callable[[], None]] = None,
    ) -> None:
        self.comm, self.record, self.every = comm, record, max(1, int(log_every_n_steps))
        self.started, self.restarts, self.max_rss_mb = started, restarts, max_rss_mb
        self.cuda = comm.device.type == "cuda"
        self._window: Optional[torch.Tensor] = None  # summed losses since the last log, on the device
        self._count = 0
        self._in_flight: Optional[_Window] = None
        self._over: Optional[Tuple[int, float]] = None  # (rank, MB) over max_rss_mb, read but not yet acted on
        self._epoch = [0.0, 0]  # global (sum, batches) of the current epoch's reduced windows
        self.last_loss: Optional[float] = None  # the mean loss of the last reduced window (all ranks)
        self.display = ProgressDisplay(progress_mode, progress_every_s, 0, 0, enabled=comm.rank == 0)
        self._tb_dir = tensorboard_dir
        self._tb: Optional[SummaryWriter] = None
        self.lr: Optional[float] = None
        self.step_seconds: Optional[float] = None  # rank 0's time per step over a recent window, the same on every rank
        self._window_start = (0, time.perf_counter())  # (step, time) where the current window began
        self.timer = StepTimer(self.cuda, on_boundary)  # this rank's local time per step, its mean in every window
        self.stragglers = StragglerRule(straggler_margin, straggler_windows)

    def plan(self, total_steps: int, max_epochs: int) -> None:
        self.display.total, self.display.max_epochs = total_steps, max_epochs

    def add_loss(self, loss: Any) -> None:
        if loss is None:
            return
        value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._window = value.float().clone() if self._window is None else self._window.add_(value)
        self._count += 1

    def after_step(self, step: int, epoch: int) -> Optional[Tuple[int, float]]:
        """Per step: its local time into the window, the display; every log_every_n_steps the previous window's metrics row and the
        next window's all-reduce. Returns (rank, MB) when a rank's peak memory passed max_rss_mb
        (the same answer on every rank, at the first step after the window that showed it was read), else None."""
        self.timer.step()
        if step % self.every:
            self.display.update(step, epoch)
            return self._pop_over()
        self._collect()
        over = self._pop_over()
        self._in_flight = self._start(step, epoch)
        if self.last_loss is None:
            self.display.update(step, epoch)
        else:
            self.display.update(step, epoch, self.last_loss)
        return over

    def _start(self, step: Optional[int], epoch: int) -> _Window:
        """This window's numbers, packed, their all-reduce started: the loss sum and count, rank 0's
        time per step, and every rank's peak memory and local time per step in its own slot (the rest
        of an epoch, `step` None, leaves its steps' local time to the next window)."""
        ws = self.comm.world_size
        now = time.perf_counter()
        first, then = self._window_start
        local = self._local_slots()
        packed = torch.zeros(local + ws + 1, dtype=torch.float64, device=self.comm.device)
        if self._window is not None:
            packed[0] = self._window  # stays on the device: no host sync
        packed[1] = self._count
        if self.comm.rank == 0 and step is not None and step > first:
            packed[-1] = (now - then) / (step - first)
        if step is not None:
            self._window_start = (step, now)
        rss = peak_rss_mb()
        packed[2 + self.comm.rank] = rss
        if self.cuda:
            packed[2 + ws + self.comm.rank] = torch.cuda.max_memory_allocated(self.comm.device) / 2**20
        if step is not None:
            packed[local + self.comm.rank] = self.timer.window()
        loss, count = self._window, self._count
        self._window, self._count = None, 0
        return _Window(
            step, epoch, time.time(), time.time() - self.started, self.lr, rss, loss, count, self.comm.start_sum(packed)
        )

    def _local_slots(self) -> int:
        """Where the packed window's local times per step begin (after the loss, the count and the memory slots)."""
        return 2 + self.comm.world_size * (2 if self.cuda else 1)

    def _pop_over(self) -> Optional[Tuple[int, float]]:
        over, self._over = self._over, None
        return over

    def _collect(self) -> None:
        """The window in flight, if any: its reduced numbers into the epoch's sums, its metrics row,
        and (rank, MB) kept for the next after_step if a rank's peak memory passed max_rss_mb."""
        window, self._in_flight = self._in_flight, None
        if window is None:
            return
        packed = window.reduced.wait().cpu()
        ws = self.comm.world_size
        total, batches = float(packed[0]), int(packed[1])
        self._epoch[0] += total
        self._epoch[1] += batches
        mean = total / batches if batches else None
        if mean is not None:
            self.last_loss = mean
        if float(packed[-1]) > 0:
            self.step_seconds = float(packed[-1])
        rss = [round(v, 1) for v in packed[2 : 2 + ws].tolist()]
        if self.max_rss_mb and max(rss) > self.max_rss_mb and self._over is None:
            self._over = rss.index(max(rss)), max(rss)
        if window.step is None:
            return
        local = packed[self._local_slots() : self._local_slots() + ws].tolist()
        self._stragglers(local, window.step)
        row: Dict[str, Any] = {"time": round(window.time, 3), "step": window.step, "epoch": window.epoch}
        if mean is not None:
            row["loss"] = round(mean, 6)
        if window.lr is not None:
            row["lr"] = window.lr
        extra = {"cuda_mb_per_rank": [round(v, 1) for v in packed[2 + ws : 2 + 2 * ws].tolist()]} if self.cuda else {}
        self.metrics(
            **row,
            wall=round(window.wall, 3),
            restart=self.restarts,
            rss_mb=window.rss_mb,
            rss_mb_per_rank=rss,
            rss_mb_max=max(rss),
            local_ms_per_rank=[round(1000 * v, 3) for v in local],
            **extra,
        )

    def _stragglers(self, local: List[float], step: int) -> None:
        """One window's local times per step through the naming rule (every rank, the same numbers):
        the slow rank records its own `straggler` event (its host and pid), rank 0 says so once."""
        named, recovered = self.stragglers.update(local)
        rule = self.stragglers
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
        """The epoch's mean loss over every rank and batch (collective; reads what is in flight at
        once); starts the next epoch's count."""
        self._collect()
        self._in_flight = self._start(None, 0)
        self._collect()
        total, batches = self._epoch
        self._epoch = [0.0, 0]
        return total / batches if batches else None

    def state_dict(self) -> Dict[str, Any]:
        """This rank's loss not yet logged and the epoch's sums: checkpointed per rank, so a resumed
        run's epoch losses are the uninterrupted run's. The window in flight (its all-reduce not yet
        read) is not waited for: its sums are saved with the loss not yet logged, and a resumed run
        reduces them with its first window."""
        window, count = self._window, self._count
        flying = self._in_flight
        if flying is not None and flying.step is not None and flying.count and flying.loss is not None:
            window = flying.loss if window is None else window + flying.loss
            count += flying.count
        saved = window.detach().cpu() if window is not None else torch.zeros((), dtype=torch.float32)
        return {"window": saved, "count": count, "epoch_sum": self._epoch[0], "epoch_batches": self._epoch[1]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._count = int(state["count"])
        self._window = state["window"].to(self.comm.device).float().clone() if self._count else None
        self._epoch = [float(state["epoch_sum"]), int(state["epoch_batches"])]

    def metrics(self, **row: Any) -> None:
        """A row of metrics.jsonl (rank 0), and the same numbers to TensorBoard when it is on."""
        self.record.metrics(**row)
        if self.comm.rank != 0 or self._tb_dir is None:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir))
        step = row.get("step", 0)
        for key, value in row.items():
            if key in ("time", "step", "epoch", "wall") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                section = "train" if key == "loss" else "epoch" if key.startswith(("train_", "val_")) else "system"
                self._tb.add_scalar(f"{section}/{key}", value, step)
            elif isinstance(value, list) and key.endswith("_per_rank"):
                for r, v in enumerate(value):
                    self._tb.add_scalar(f"system/{key[:-9]}/rank{r}", v, step)

    def close(self) -> None:
        """The last window's row (every rank, at the same step), unless an error is unwinding: then a
        peer may be gone and what is in flight is left."""
        if self._in_flight is not None and sys.exc_info()[0] is None:
            self._collect()
        self._in_flight = None
        self.display.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
