"""What every rank does about a finding, together: roll back, skip, heal, or stop.

A loss anomaly at step a (a non-finite loss or gradient norm, a spike): every rank restores the
newest state at or before a - 1 (a snapshot in memory, else the newest committed checkpoint: both
are kept only once known healthy, steadfast/health/guard.py), leaves out the data that produced it
(`anomaly.skip`: the batches of step a on every rank, or every batch since the state restored)
by recording it in the progress (`Progress.skipped`, so a resume and a re-run skip the same
samples), optionally scales the learning rate for `lr_scale_steps` steps from a, and goes on from
the restored step. Replicas that diverged: a strict majority's parameters replace the others'
(`heal`); with no majority (two ranks), every rank goes back to the newest state at or before the
last step at which the fingerprints agreed, and trains the same data again. At most
`max_rollbacks` rollbacks in any `window_steps` steps: the one over it still goes back (the state
committed is the healthy one), then the run stops with the evidence.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..checkpoint.state import Progress
from ..checkpoint.tracked import Checkpointer
from ..config import AnomalyConf, SkipKind
from ..contract.events import Event
from ..distributed.comm import Comm
from ..distributed.exchange import Exchange
from ..loop.data import RunData
from . import replicas
from .guard import Finding, Guard, Params
from .watch import Watch

log = logging.getLogger("steadfast")
SAMPLES_RECORDED = 64  # dataset indices a rolled_back event lists


@dataclass(frozen=True)
class Stop:
    """The run stops now: why, and whether the state it stands at (then known healthy) is committed."""

    message: str
    commit: bool = True


class Recovery:
    def __init__(
        self,
        conf: AnomalyConf,
        guard: Guard,
        checkpointer: Checkpointer,
        data: RunData,
        exchange: Exchange,
        comm: Comm,
        record: Callable[..., None],
        rewound: Callable[[int], None],
        params: Optional[Params] = None,
    ) -> None:
        """`rewound(step)`: the loop's parts after a rollback to `step` (the boundary, the snapshot cadence, the clocks)."""
        self.conf, self.guard, self.checkpointer, self.data = conf, guard, checkpointer, data
        self.exchange, self.comm, self.record, self.rewound, self.params = exchange, comm, record, rewound, params
        self.progress: Progress = guard.progress
        self._lrs: List[float] = []  # the learning rates a scaled optimizer step put aside

    # ---- acting on a finding ------------------------------------------------------------------
    def act(self, finding: Finding, step: int) -> Optional[Stop]:
        """Every rank, at `step`: heal, or roll back. Returns why the run must stop now, else None."""
        if finding.divergence and finding.majority:
            self._heal(finding, step)
            return None
        return self._roll_back(finding, step)

    def _roll_back(self, finding: Finding, step: int) -> Optional[Stop]:
        p, conf = self.progress, self.conf
        recent = 1 + sum(1 for a in p.rollbacks if a > finding.step - conf.window_steps)
        batch = self._batch_of(finding.step) if not finding.divergence else None
        self.exchange.flush(step)  # nothing left in flight from the steps abandoned
        tensor = hosts = None
        if finding.divergence:
            tensor, hosts = self._named(finding)
        kept = ([list(s) for s in p.skipped], list(p.rollbacks), list(p.diverged))
        restored = self.checkpointer.roll_back(finding.healthy)
        self.guard.take()  # what the flush found is of the steps abandoned
        if restored is None:
            why = (
                f"{_said(finding)}, and there is no healthy state at or before step {finding.healthy} to go back to "
                "(no snapshot in memory, no committed checkpoint): nothing was committed. Save more often "
                "(checkpoint.every_n_steps) or keep snapshots on (snapshot.every_n_steps)"
            )
            return Stop(why, commit=False)
        p.skipped, p.rollbacks, p.diverged = kept
        skipped = self._skipped(finding, batch)
        samples = self.data.indices(skipped) if skipped is not None else None
        if skipped is not None:
            p.skipped.append(skipped)
        if not finding.divergence:
            p.rollbacks.append(finding.step)
        self.data.rewind()
        self.guard.start(restored.step, restored.step)
        self.rewound(restored.step)
        self.record(
            Event.ANOMALY,
            **_found(finding),
            agreed_at=step,
            action="rolled_back",
            restored_step=restored.step,
            source=self.checkpointer.source,
            **({"skipped": skipped} if skipped is not None else {}),
            **({"samples": samples[:SAMPLES_RECORDED]} if samples is not None else {}),
            **({"hosts": hosts, "tensor": tensor} if finding.divergence else {}),
        )
        what = f"skipping {_batches(skipped)}" if skipped else "training the same data again"
        log.warning(
            "%s; every rank went back to step %d (%s) at step %d, %s%s",
            _said(finding, tensor),
            restored.step,
            "a snapshot in memory" if self.checkpointer.source == "memory" else "a checkpoint",
            step,
            what,
            f"; rollback {recent} of at most {conf.max_rollbacks} in {conf.window_steps} steps" if not finding.divergence else "",
        )
        if not finding.divergence and recent > conf.max_rollbacks:
            why = (
                f"{recent} rollbacks within {conf.window_steps} steps (anomaly.max_rollbacks={conf.max_rollbacks}), the last "
                f"for {_said(finding)}: stopped at the healthy step {restored.step}, committed. The rollbacks are in "
                "events.jsonl (`anomaly`); look at the data and the learning rate, raise anomaly.max_rollbacks, or run "
                "the same command again to continue"
            )
            return Stop(why)
        return None

    def _heal(self, finding: Finding, step: int) -> None:
        self.exchange.flush(step)  # fingerprints in flight are of the replicas before the heal
        self.guard.take()
        tensor, hosts = self._named(finding)
        source = next(r for r in range(self.comm.world_size) if r not in finding.ranks)
        replicas.heal(self.comm, self.params() if self.params is not None else [], source)
        self.guard.replicas_agree_at = step
        p = self.progress
        p.diverged.extend(finding.ranks)
        suspect = sorted({r for r in p.diverged if p.diverged.count(r) >= 2})
        self.record(
            Event.ANOMALY,
            **_found(finding),
            agreed_at=step,
            action="healed",
            source=f"rank {source}",
            hosts=hosts,
            tensor=tensor,
            suspect=suspect,
        )
        log.warning(
            "%s; its parameters were replaced by rank %d's at step %d%s",
            _said(finding, tensor, hosts),
            source,
            step,
            f". Suspect hardware (diverged twice or more): rank(s) {', '.join(map(str, suspect))}" if suspect else "",
        )

    def _named(self, finding: Finding) -> Tuple[Optional[str], Optional[List[str]]]:
        """Collective: the first parameter that differs, and the hosts of the ranks that differ."""
        params = self.params() if self.params is not None else []
        tensor = replicas.first_differing(self.comm, params, finding.ranks)
        gathered = self.comm.gather_object(socket.gethostname())
        hosts = [gathered[r] for r in finding.ranks] if gathered is not None else None
        return tensor, hosts

    # ---- what is skipped ----------------------------------------------------------------------
    def _batch_of(self, step: int) -> Optional[List[int]]:
        """[epoch, first sample, samples, first batch, batches] of what step `step` trained (before the rollback)."""
        after = self.guard.position(step)
        if after is None:
            return None
        before = self.guard.position(step - 1)
        if before is None or before[0] != after[0] or before[1] > after[1]:
            before = (after[0], 0, 0)
        return [after[0], before[2], after[2] - before[2], before[1], after[1] - before[1]]

    def _skipped(self, finding: Finding, batch: Optional[List[int]]) -> Optional[List[int]]:
        if batch is None or (batch[2] == 0 and batch[4] == 0):
            return None
        if self.conf.skip is SkipKind.batch:
            return batch
        p = self.progress  # restored: where the window starts (in the anomaly's epoch)
        epoch, first, samples, first_batch, batches = batch
        start = (p.sample_in_epoch, p.batch_in_epoch) if p.epoch == epoch else (0, 0)
        return [epoch, start[0], first + samples - start[0], start[1], first_batch + batches - start[1]]

    # ---- the learning rate after a rollback -------------------------------------------------------
    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Scale the learning rate of the optimizer's steps that anomaly.lr_scale covers: only for the
        step itself, so schedulers and checkpoints see the rates as they are."""
        if self.conf.lr_scale_steps and self.conf.lr_scale != 1:
            optimizer.register_step_pre_hook(self._scale)
            optimizer.register_step_post_hook(self._unscale)

    def _scale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step, n = self.progress.global_step + 1, self.conf.lr_scale_steps
        if any(a <= step < a + n for a in self.progress.rollbacks):
            self._lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * self.conf.lr_scale

    def _unscale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g, lr in zip(optimizer.param_groups, self._lrs):
            g["lr"] = lr
        self._lrs = []


class RankState:
    """This rank's own checkpointed state: the telemetry's and the watch's together, under the one
    name per-rank state had before the watch (a checkpoint of an older version resumes: its watch
    starts afresh)."""

    KEY = "anomaly_watch"

    def __init__(self, telemetry: Any, watch: Watch) -> None:
        self.telemetry, self.watch = telemetry, watch

    def state_dict(self) -> Dict[str, Any]:
        return {**self.telemetry.state_dict(), self.KEY: self.watch.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        watched = state.pop(self.KEY, None)
        self.telemetry.load_state_dict(state)
        if watched is None:
            self.watch.reset()
        else:
            self.watch.load_state_dict(watched)


def _found(finding: Finding) -> Dict[str, Any]:
    """A finding's fields of its `anomaly` event: the ranks that showed it, the first first."""
    ranks = [finding.rank, *(r for r in finding.ranks if r != finding.rank)] if finding.rank >= 0 else list(finding.ranks)
    value = {"value": finding.value} if math.isfinite(finding.value) else {}
    return {"anomaly": finding.kind, "step": finding.step, "ranks": ranks, **value}


def _said(finding: Finding, tensor: Optional[str] = None, hosts: Optional[List[str]] = None) -> str:
    if finding.divergence:
        where = f" on {', '.join(hosts)}" if hosts else ""
        ranks = ", ".join(map(str, finding.ranks))
        who = (
            f"rank(s) {ranks}{where} differ from the majority"
            if finding.majority
            else f"ranks {ranks}{where} differ, with no majority to tell which is right"
        )
        return f"replicas diverged at step {finding.step}: {who}" + (f", first in {tensor}" if tensor else "")
    what = {"nonfinite_loss": "non-finite loss", "loss_spike": "loss spike", "nonfinite_grad_norm": "non-finite gradient norm"}
    return f"{what.get(finding.kind, finding.kind)} ({finding.value:.6g}) on rank {finding.rank} at step {finding.step}"


def _batches(skipped: List[int]) -> str:
    epoch, first, samples, first_batch, batches = skipped
    if samples:
        return f"{samples} samples (epoch {epoch + 1}, {first}..{first + samples - 1} of its order)"
    return f"{batches} batch(es) (epoch {epoch + 1}, batches {first_batch}..{first_batch + batches - 1})"
