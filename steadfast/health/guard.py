"""Every rank's health, agreed: what each rank's watch found and its replicas' fingerprint ride the
control plane's one periodic message (steadfast/distributed/exchange.py), so every rank reads the
same answer at the same step and acts on it together, with no collective and no host-device
synchronisation of its own.

What the answers establish: `healthy_through`, the step up to which no rank saw an anomaly (a state
of a later step is not yet known healthy: a checkpoint waits for it, `confirm`, and the memory tier
keeps the newest snapshot at or before it, `protect`); `replicas_agree_at`, the last step at which
every rank's fingerprint was the same; and a `Finding` when something was seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpoint.state import Progress
from ..distributed.exchange import Exchange
from . import replicas
from .watch import BLOCK, KINDS, Watch

DIVERGENCE = "divergence"
PRUNE_AT = 4096  # positions kept before the older ones go, at once (a pop per step cost more)
Params = Callable[[], List[Tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class Finding:
    """What every rank agreed it saw, the same on every rank."""

    kind: str  # nonfinite_loss, loss_spike, nonfinite_grad_norm (watch.KINDS) or divergence
    step: int  # the first step that showed it; a divergence: the step of the fingerprints that differed
    rank: int  # the rank that showed it first (the lowest at that step); a divergence: the first that differs
    value: float  # the loss or gradient norm seen (a divergence: nan)
    ranks: Tuple[int, ...]  # every rank that showed one; a divergence: every rank that differs
    agreed_at: int  # the step at which every rank knew it
    healthy: int  # the newest step a rollback may restore
    majority: bool = True  # a divergence: a strict majority agrees (the others are healed); False: roll back

    @property
    def divergence(self) -> bool:
        return self.kind == DIVERGENCE


class Guard:
    def __init__(
        self, watch: Watch, exchange: Exchange, progress: Progress, params: Optional[Params], every_n_steps: int
    ) -> None:
        """`params`: the replicated parameters to fingerprint every `every_n_steps` steps (None: none)."""
        self.watch, self.exchange, self.progress = watch, exchange, progress
        self.params, self.every = params, every_n_steps if params is not None else 0
        self.healthy_through = 0  # no rank saw an anomaly in any step up to this one
        self.posted_through = 0  # the last step the verdicts in flight cover
        self.replicas_agree_at = 0
        self.found: Optional[Finding] = None  # agreed, not yet acted on
        self.positions: Dict[int, Tuple[int, int, int]] = {}  # step -> (epoch, batch, sample) after it, from the healthy on
        self._print: Optional[List[Any]] = None  # [step, the fingerprint on its way to the host, its event, sends since]
        self._host: Optional[torch.Tensor] = None  # where it lands (pinned on a GPU)
        exchange.ride(self._post)

    def start(self, step: int, healthy: int) -> None:
        """Where the run stands (an attempt's start, a rollback): `healthy`, the newest step known healthy."""
        p = self.progress
        self.positions = {step: (p.epoch, p.batch_in_epoch, p.sample_in_epoch)}
        self.healthy_through = self.replicas_agree_at = healthy
        self.posted_through, self._print = healthy, None

    # ---- per step ---------------------------------------------------------------------------
    def observe(self, step: int, loss: Any, grad_norm: Any) -> None:
        watch = self.watch
        if loss.__class__ is float and grad_norm is None and step // BLOCK == watch.block:
            watch.pending.append((step, loss))  # Watch.observe's work on most steps, inline (it runs cold)
        else:
            watch.observe(step, loss, grad_norm)
        p = self.progress
        self.positions[step] = (p.epoch, p.batch_in_epoch, p.sample_in_epoch)

    def next_due(self, step: int) -> Optional[int]:
        """The next step after `step` at which `at_step` has work (a fingerprint), or None."""
        return step - step % self.every + self.every if self.every else None

    def at_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.fingerprint(step)

    def fingerprint(self, step: int, at_once: bool = False) -> None:
        """This rank's fingerprint at `step`, on its way to the host; it goes out at the second send
        after (its copy long landed) or at once (`at_once`: it replaces one still waiting to go)."""
        if self.params is None or (self._print is not None and (self._print[0] == step or not at_once)):
            return
        params = self.params()
        if not params:
            return
        value = replicas.combined(replicas.sums(params))
        if self._host is None:
            self._host = torch.empty((), dtype=torch.int64, pin_memory=value.is_cuda)
        host = self._host  # one in flight at a time: `_print` is None before a new one
        host.copy_(value, non_blocking=True)
        landed = torch.cuda.Event() if value.is_cuda else None  # type: ignore[no-untyped-call]
        if landed is not None:
            landed.record()
        self._print = [step, host, landed, 0]

    def take(self) -> Optional[Finding]:
        found, self.found = self.found, None
        return found

    def position(self, step: int) -> Optional[Tuple[int, int, int]]:
        return self.positions.get(step)

    # ---- on the control plane -------------------------------------------------------------------
    def _post(self, step: int, at_once: bool) -> None:
        verdict = self.watch.verdict(step, at_once)
        if verdict is not None:
            covered, (first, kind, value) = verdict
            self.posted_through = max(self.posted_through, covered)
            self.exchange.post([], [float(first), float(kind), value], lambda shared, own: self._verdicts(covered, own))
        if self._print is not None and (at_once or self._print[3] >= 1):
            at, host, landed, _ = self._print
            self._print = None
            if landed is not None:
                landed.synchronize()  # two sends ago: landed long since (at once: waited for)
            self.exchange.post([], [replicas.fold(int(host))], lambda shared, own: self._prints(at, [r[0] for r in own]))
        elif self._print is not None:
            self._print[3] += 1

    def _verdicts(self, covered: int, own: List[List[float]]) -> None:
        seen = sorted((int(r[0]), rank, int(r[1]), r[2]) for rank, r in enumerate(own) if r[0] > 0)
        if not seen:
            healthy = self.healthy_through = max(self.healthy_through, covered)
            if len(self.positions) > PRUNE_AT:  # the steps before the newest healthy one are never asked for
                self.positions = {step: at for step, at in self.positions.items() if step >= healthy}
            return
        step, rank, kind, value = seen[0]
        ranks = tuple(sorted({r for _, r, _, _ in seen}))
        self._found(Finding(KINDS.get(kind, str(kind)), step, rank, value, ranks, self.exchange.step, step - 1))
        self.healthy_through = max(self.healthy_through, min(step - 1, covered))

    def _prints(self, step: int, values: List[float]) -> None:
        common, differ = replicas.majority(values)
        if not differ:
            self.replicas_agree_at = max(self.replicas_agree_at, step)
            return
        if common is None:  # no majority (two ranks): no telling which, every rank is named
            first, differ = -1, list(range(len(values)))
        else:
            first = differ[0]
        self._found(
            Finding(
                DIVERGENCE, step, first, math.nan, tuple(differ), self.exchange.step, self.replicas_agree_at, common is not None
            )
        )

    def _found(self, finding: Finding) -> None:
        """Keep the finding that asks for the older state (the other, if real, is found again after)."""
        if self.found is None or finding.healthy < self.found.healthy:
            self.found = finding

    # ---- at once --------------------------------------------------------------------------------
    def confirmed(self, step: int) -> bool:
        """Every step to `step` agreed healthy, the replicas the same at it, nothing waiting to be acted on."""
        return self.found is None and self.healthy_through >= step and (not self.every or self.replicas_agree_at >= step)

    def confirm(self, step: int) -> Optional[Finding]:
        """Collective, at once (a checkpoint, an epoch's end): every rank's verdict to `step` and the
        replicas' fingerprints at it, read now; what was found (taken), else None."""
        if not self.confirmed(step):
            self.fingerprint(step, at_once=True)
            self.exchange.flush(step)
        return self.take()

    def protect(self) -> Sequence[int]:
        """The steps whose newest snapshot at or before the memory tier keeps: the newest known healthy
        (what a rollback restores) and the newest whose health is being agreed (the next healthy one)."""
        return self.healthy_through, self.posted_through
