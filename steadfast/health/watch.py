"""One rank's watch over its own steps: a non-finite loss or gradient norm, and a loss spike.

Cheap by design. On the host (a CPU loss, whose value the metrics read anyway) a step only keeps
the number; the steps not yet judged are judged together, in order, when a verdict, the block's end
or a state asks (the reference is frozen within a block: the verdicts of judging each at its step). On a GPU nothing is read per step: the step's loss tensor is kept, as the metrics
keep it, and judged on the device a block at a time (BLOCK steps, or the steps since the last
verdict) in a few kernels; the verdict, the first bad step with its kind and value, is copied to
the host without waiting and posted to the other ranks an exchange later (steadfast/health/guard.py).

The spike rule, the same on the host and on the device: a step's loss against the moving average
of the healthy losses before its block (the reference is frozen within a block of BLOCK steps) is a
spike when it is above the average by `spike_zscore` standard deviations and is `spike_ratio` times
the average (either test off when null), once `warmup_steps` healthy losses were seen. The average
and the variance come from exponential moving averages of the loss and of its square, each healthy
loss weighing 1/ema_steps, bias-corrected as Adam's moments are; they take a block's healthy losses,
in order, when it ends. A spike or a non-finite loss never enters them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import AnomalyConf

BLOCK = 64  # steps judged against one reference (on a GPU: a few dozen kernels a block)
NONFINITE_LOSS, SPIKE, NONFINITE_GRAD = 1, 2, 3
KINDS = {NONFINITE_LOSS: "nonfinite_loss", SPIKE: "loss_spike", NONFINITE_GRAD: "nonfinite_grad_norm"}
Verdict = Tuple[int, int, float]  # (the first bad step: 0 none, its kind, the value seen)
NONE: Verdict = (0, 0, 0.0)


class Watch:
    """This rank's losses (and gradient norms) as the steps go; a Stateful of this rank's own (it is
    checkpointed with the telemetry's per-rank state, so a resumed run judges as the uninterrupted one)."""

    def __init__(self, conf: AnomalyConf, judge_later: bool = False) -> None:
        """`judge_later`: CPU tensors too are judged a block at a time, as on a GPU (the tests and the
        benchmark run the device's path on the CPU with it)."""
        self.judge_later = judge_later
        self.nonfinite = conf.nonfinite
        self.zscore2 = None if conf.spike_zscore is None else conf.spike_zscore**2
        self.excess = None if conf.spike_ratio is None else conf.spike_ratio - 1.0
        self.spikes = conf.spikes
        self.alpha, self.warmup = 1.0 / conf.ema_steps, conf.warmup_steps
        self.reset()

    def reset(self) -> None:
        self.m1 = self.m2 = self.weight = 0.0  # the moving averages (not yet bias-corrected), their total weight
        self.seen = 0  # healthy losses that entered them
        self.block = -1  # the block the values below belong to
        self.values: List[Tuple[int, float]] = []  # host: this block's healthy (step, loss), in order
        self.pending: List[Tuple[int, float]] = []  # host: this block's (step, loss) not yet judged, in order
        self.first: Verdict = NONE  # host: the first bad step not yet rolled back
        self.device: Optional[_OnDevice] = None

    # ---- per step ---------------------------------------------------------------------------
    def observe(self, step: int, loss: Any, grad_norm: Any = None) -> None:
        if step // BLOCK != self.block:
            self._end_block()
            self.block = step // BLOCK
        if loss.__class__ is float and grad_norm is None:  # most steps of a CPU loss (read once by the step
            # boundary): judged later, with the block's others (_judge_pending), against the same reference
            self.pending.append((step, loss))
            return
        self._judge_pending()
        for value, is_loss in ((loss, True), (grad_norm, False)):
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and (self.judge_later or not value.is_cpu):
                if self.device is None:
                    self.device = _OnDevice(value.device, self)
                self.device.add(step, value.detach(), is_loss)
                continue
            x = value.item() if isinstance(value, torch.Tensor) else float(value)
            if is_loss:
                kind = self._kind(x, self._reference())
                if kind != SPIKE and math.isfinite(x):
                    self.values.append((step, x))
            else:
                kind = 0 if math.isfinite(x) or not self.nonfinite else NONFINITE_GRAD
            if kind and not self.first[0]:
                self.first = (step, kind, x)

    def _reference(self) -> Optional[Tuple[float, float]]:
        """The spike rule's (mean, variance), frozen within a block; None while it does not apply."""
        if not self.spikes or self.seen < self.warmup or self.weight <= 0:
            return None
        mean = self.m1 / self.weight
        return mean, max(self.m2 / self.weight - mean * mean, 0.0)

    def _kind(self, x: float, reference: Optional[Tuple[float, float]]) -> int:
        if not math.isfinite(x):
            return NONFINITE_LOSS if self.nonfinite else 0
        if reference is None:
            return 0
        mean, var = reference
        d = x - mean
        if d <= 0 or (self.excess is not None and d <= self.excess * abs(mean)):
            return 0
        return SPIKE if self.zscore2 is None or d * d > self.zscore2 * var else 0

    def _judge_pending(self) -> None:
        """The losses observed but not yet judged, in order, as each would have been at its step: the
        reference changes only when a block ends, and this runs first there (and before anything reads
        `first` or `values`)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        reference, first, values = self._reference(), self.first, self.values
        for step, x in pending:  # as `observe` judges a loss at its step, against the block's reference
            kind = self._kind(x, reference)
            if kind:
                if not first[0]:
                    first = (step, kind, x)
            elif math.isfinite(x):  # not with the non-finite check off
                values.append((step, x))
        self.first = first

    def _end_block(self) -> None:
        """The block's healthy losses into the moving averages, in order."""
        self._judge_pending()
        if self.device is not None:
            self.device.end_block()
        a, m1, m2, weight = self.alpha, self.m1, self.m2, self.weight
        b = 1 - a
        for _, x in self.values:  # in locals: the same operations, in the same order
            m1, m2, weight = b * m1 + a * x, b * m2 + a * x * x, b * weight + a
        self.m1, self.m2, self.weight = m1, m2, weight
        self.seen += len(self.values)
        self.values = []

    # ---- the verdict --------------------------------------------------------------------------
    def verdict(self, step: int, at_once: bool) -> Optional[Tuple[int, Verdict]]:
        """(the last step it covers, the first bad step not yet rolled back), for the other ranks. On the
        host: now, to `step`. On a device: the one copied at the previous call (None at the first),
        unless `at_once` (then now, waited for)."""
        self._judge_pending()
        if self.device is None:
            return step, self.first
        return self.device.verdict(step, at_once)

    # ---- Stateful -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        self._judge_pending()
        m1, m2, weight, seen, values, first = self.device.numbers() if self.device is not None else self._numbers()
        return {
            "moments": torch.tensor([m1, m2, weight], dtype=torch.float64),
            "seen": seen,
            "block": self.block,
            "values": _padded(values),
            "count": len(values),
            "first": [int(first[0]), int(first[1])],
            "first_value": torch.tensor([first[2]], dtype=torch.float64),
        }

    def _numbers(self) -> Tuple[float, float, float, int, List[float], Verdict]:
        return self.m1, self.m2, self.weight, self.seen, [x for _, x in self.values], self.first

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        moments, values, first = state["moments"].tolist(), state["values"].tolist(), state["first"]
        count = state.get("count", len(values))  # a state saved before the padding: every value
        if len(moments) != 3 or not isinstance(first, list) or len(first) != 2:
            raise ValueError("anomaly watch: not the state of one")
        if type(count) is not int or not 0 <= count <= len(values):
            raise ValueError(f"anomaly watch: count must be an int from 0 to {len(values)}")
        values = values[:count]
        self.reset()
        self.m1, self.m2, self.weight = moments
        self.seen, self.block = int(state["seen"]), int(state["block"])
        self.values = [(-1, float(x)) for x in values]
        self.first = (int(first[0]), int(first[1]), float(state["first_value"][0]))


def _padded(values: List[float]) -> torch.Tensor:
    """A block's healthy losses, zeros after them up to a whole number of blocks (the state's `count`
    says how many are losses): the state keeps its shape from step to step, so a snapshot's or a save's
    layout is reused (checkpoint/reuse.py) instead of planned anew at every one."""
    out = torch.zeros(max(1, -(-len(values) // BLOCK)) * BLOCK, dtype=torch.float64)
    out[: len(values)] = torch.tensor(values, dtype=torch.float64)
    return out


class _OnDevice:
    """The watch's work on a GPU: losses kept as tensors, judged in a few kernels a block, verdicts
    copied to pinned host memory behind an event (no host-device synchronisation per step)."""

    def __init__(self, device: torch.device, watch: Watch) -> None:
        """Takes over the watch's numbers (a fresh one's, or what a checkpoint restored)."""
        self.dev, self.watch = device, watch
        self.losses: List[Tuple[int, torch.Tensor]] = []  # not yet judged
        self.grads: List[Tuple[int, torch.Tensor]] = []
        f64 = torch.float64
        values = torch.tensor([x for _, x in watch.values], dtype=f64, device=device)
        # judged losses of this block and their healthy mask
        self.healthy: List[Tuple[torch.Tensor, torch.Tensor]] = [(values, torch.ones_like(values, dtype=torch.bool))]
        self.first = torch.tensor(watch.first, dtype=f64, device=device)  # [step (0: none), kind, value]
        self.state = torch.tensor([watch.m1, watch.m2, watch.weight, float(watch.seen)], dtype=f64, device=device)
        self.copy: Optional[Tuple[int, torch.Tensor, Any]] = None  # the verdict on its way to the host: its step, event
        pinned = device.type == "cuda"
        self.hosts = [torch.empty(3, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]  # used in turn
        watch.values = []

    def add(self, step: int, value: torch.Tensor, is_loss: bool) -> None:
        (self.losses if is_loss else self.grads).append((step, value))

    def judge(self) -> None:
        """The losses and gradient norms not yet judged, against the block's reference, into `first`."""
        w, cands = self.watch, []
        if self.losses:
            steps, x = self._stacked(self.losses)
            finite = torch.isfinite(x)
            kind = torch.zeros_like(x).masked_fill(~finite, float(NONFINITE_LOSS) if w.nonfinite else 0.0)
            healthy = finite
            if w.spikes:
                m1, m2, weight, seen = self.state.unbind()
                mean = m1 / weight.clamp(min=1e-300)
                d = x - mean
                spike = finite & (seen >= w.warmup) & (weight > 0) & (d > 0)
                if w.excess is not None:
                    spike &= d > w.excess * mean.abs()
                if w.zscore2 is not None:
                    spike &= d * d > w.zscore2 * (m2 / weight.clamp(min=1e-300) - mean * mean).clamp(min=0)
                kind = torch.where(spike, float(SPIKE), kind)
                healthy = finite & ~spike
            self.healthy.append((x, healthy))
            cands.append((steps, kind, x))
        if self.grads and w.nonfinite:
            steps, g = self._stacked(self.grads)
            cands.append((steps, torch.zeros_like(g).masked_fill(~torch.isfinite(g), float(NONFINITE_GRAD)), g))
        self.losses, self.grads = [], []
        for steps, kind, x in cands:
            where = torch.where(kind > 0, steps, math.inf)
            i = where.argmin().reshape(1)  # index_select: an index tensor, never read on the host
            found = torch.cat([where.index_select(0, i), kind.index_select(0, i), x.index_select(0, i)])
            self.first = torch.where((found[0] < math.inf) & (self.first[0] == 0), found, self.first)

    def _stacked(self, entries: List[Tuple[int, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(their steps, their values) on the device; the steps made there, a run of consecutive ones at a
        time (a copy from the host's pageable memory would wait for the device)."""
        x = torch.stack([v.reshape(()) for _, v in entries]).double()
        runs, start = [], 0
        for i in range(1, len(entries) + 1):
            if i == len(entries) or entries[i][0] != entries[i - 1][0] + 1:
                runs.append(torch.arange(entries[start][0], entries[i - 1][0] + 1, dtype=torch.float64, device=self.dev))
                start = i
        return (runs[0] if len(runs) == 1 else torch.cat(runs)), x

    def end_block(self) -> None:
        """The block's healthy losses into the moving averages, in order, in one pass: the average after
        them is a weighted sum (each healthy loss weighs alpha times the decay of the ones after it)."""
        self.judge()
        if not self.healthy:
            return
        x = torch.cat([v for v, _ in self.healthy])
        keep = torch.cat([h for _, h in self.healthy]).double()
        self.healthy = []
        if not x.numel():
            return
        a = self.watch.alpha
        decay = 1 - a * keep
        after = torch.cumprod(decay.flip(0), 0).flip(0)  # after[k]: the decay of k and of every loss after it
        later = torch.cat([after[1:], after.new_ones(1)])
        weight = a * keep * later
        x = torch.where(keep > 0, x, 0.0)
        s = self.state
        total = after[0]
        self.state = torch.stack(
            [
                total * s[0] + (weight * x).sum(),
                total * s[1] + (weight * x * x).sum(),
                total * s[2] + weight.sum(),
                s[3] + keep.sum(),
            ]
        )

    def verdict(self, step: int, at_once: bool) -> Optional[Tuple[int, Verdict]]:
        self.judge()
        host = self.hosts[0] if self.copy is None or self.copy[1] is not self.hosts[0] else self.hosts[1]
        host.copy_(self.first, non_blocking=True)
        event = torch.cuda.Event() if self.dev.type == "cuda" else None  # type: ignore[no-untyped-call]
        if event is not None:
            event.record()
        previous, self.copy = self.copy, (step, host, event)
        if at_once:
            previous, self.copy = self.copy, None
        if previous is None:
            return None
        covered, values, landed = previous
        if landed is not None:
            landed.synchronize()  # recorded an exchange ago: landed long since (at once: waited for)
        first, kind, value = values.tolist()
        return covered, (int(first), int(kind), value)

    def numbers(self) -> Tuple[float, float, float, int, List[float], Verdict]:
        """The watch's state from the device (a checkpoint or a snapshot: they wait for the device anyway)."""
        self.judge()
        m1, m2, weight, seen = self.state.tolist()
        step, kind, value = self.first.tolist()
        values = [v for x, h in self.healthy for v, ok in zip(x.tolist(), h.tolist()) if ok]
        return m1, m2, weight, int(seen), values, (int(step), int(kind), value)
