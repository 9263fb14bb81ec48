"""The anomaly guard in a run's loop: what `steadfast.Run` asks of it, and where it plugs in.

Made at the end of `Run.__init__`, it puts the watch into every rank's checkpointed state, the guard
into the step boundary (each step's loss and gradient norm observed; the answers acted on where they
are read), the memory tier's choice of the slot to write, the checkpointer's save (a state is
committed only once its steps are agreed healthy) and the run's loader (the end of its batches is
a point where every rank agrees at once). When is a finding acted on:

- at a step boundary (the message that brought it) or at a save: at once, if the run's own loader
  (run.loader, run.batches) is under way (it starts again from the state restored) or the loop is
  between epochs; inside an epoch whose data the run cannot move back (a loop's own DataLoader over
  run.sampler), at the epoch's end;
- at an epoch's end (the run's loader handed out its last batch, or run.epochs' end of it): at once;
  a rollback then sends the epoch (or an earlier one) round again;
- outside run.epochs with no loader of the run's (a loop of its own), the run goes back, commits
  the healthy state and stops: running the same command again continues from there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from ..checkpoint.state import Progress
from ..checkpoint.tracked import Checkpointer
from ..config import Settings
from ..contract.exits import EXIT_PREEMPTED
from ..contract.stop import StopReason
from ..distributed.comm import Comm
from ..distributed.exchange import Exchange
from ..faults import FaultInjector
from ..loop.boundary import StepBoundary
from ..loop.data import RunData
from ..telemetry.metrics import Telemetry
from ..telemetry.records import RunRecord
from . import replicas
from .guard import Finding, Guard
from .recovery import RankState, Recovery, Stop
from .watch import Watch


class RunParts(Protocol):
    """What the guard needs of steadfast.Run: its parts, never the façade's methods but `beat`."""

    settings: Settings
    checkpointer: Checkpointer
    telemetry: Telemetry
    exchange: Exchange
    progress: Progress
    data: RunData
    comm: Comm
    record: RunRecord
    boundary: StepBoundary
    faults: FaultInjector
    model: Optional[torch.nn.Module]

    @property
    def world_size(self) -> int: ...

    def beat(self, phase: str = "train") -> None: ...


class RunHealth:
    def __init__(self, run: RunParts, stop: Callable[..., None]) -> None:
        """`stop`: the run's own stop (every rank, at the same step: commit, record, StopRun)."""
        conf = run.settings.anomaly
        self.run, self.stop = run, stop
        self.watch = Watch(conf)
        run.checkpointer.per_rank["telemetry"] = RankState(run.telemetry, self.watch)
        self.model: Optional[torch.nn.Module] = None
        replicated = run.settings.parallel.kind.value == "ddp" and run.world_size > 1
        self.guard: Optional[Guard] = None
        self.recovery: Optional[Recovery] = None
        if not (conf.watches or (conf.fingerprint_every_n_steps and replicated)):
            return
        params = self._replicated if replicated else None
        self.guard = guard = Guard(self.watch, run.exchange, run.progress, params, conf.fingerprint_every_n_steps)
        self.recovery = Recovery(
            conf, guard, run.checkpointer, run.data, run.exchange, run.comm, run.record.event, self._rewound, params
        )
        run.boundary.guard, run.boundary.act = guard, self._at_step
        if run.boundary.memory is not None:
            run.boundary.memory.protect = guard.protect
        run.checkpointer.healthy = self.commits
        run.data.position.at_end = self.rolled_back_at_epoch_end

    # ---- what Run calls ---------------------------------------------------------------------------
    def watch_model(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """run.setup's model and optimizer: the replicas to compare, the faults that act on them (at
        the step about to run), the learning rate scaled after a rollback."""
        self.model = model
        self.run.faults.watch(model, lambda: self.run.progress.global_step + 1)
        if optimizer is not None and self.recovery is not None:
            self.recovery.watch_optimizer(optimizer)

    def start(self) -> None:
        """After run.resume: a committed checkpoint is known healthy, a snapshot in memory once the
        ranks say so (the newest committed checkpoint is, meanwhile)."""
        if self.guard is None:
            return
        run = self.run
        step = run.progress.global_step
        self.guard.start(step, (run.checkpointer.last_saved_step or 0) if run.checkpointer.source == "memory" else step)

    def result(self) -> Dict[str, Any]:
        p = self.run.progress
        return {
            "rollbacks": len(p.rollbacks),
            "skipped_samples": sum(s[2] for s in p.skipped),
            "replica_divergences": len(p.diverged),
        }

    def commits(self) -> bool:
        """Before a save (collective): every rank's health to this step agreed at once; an anomaly
        found then is acted on. True: commit the state the run now stands at (known healthy)."""
        assert self.guard is not None
        run = self.run
        found = self.guard.confirm(run.progress.global_step)
        if found is None:
            return True
        done = self.act(found)  # back: the state restored is committed, unless it is a committed checkpoint already
        return done == HEALED or (done == BACK and run.checkpointer.last_saved_step != run.progress.global_step)

    def rolled_back_at_epoch_end(self) -> bool:
        """The epoch's batches are done (the run's loader's, or run.epochs' end of the epoch): every
        rank's health agreed at once. True when an anomaly found then sent the run back."""
        if self.guard is None:
            return False
        found = self.guard.confirm(self.run.progress.global_step)
        return found is not None and self.act(found, epoch_end=True) == BACK

    # ---- acting ------------------------------------------------------------------------------------
    def _at_step(self, finding: Finding) -> bool:
        return self.act(finding) == BACK

    def act(self, finding: Finding, epoch_end: bool = False) -> str:
        """Every rank, at the same step: HEALED, BACK (rolled back), or LATER (kept for the epoch's end)."""
        assert self.recovery is not None and self.guard is not None
        run = self.run
        if finding.divergence and finding.majority:
            self.recovery.act(finding, run.progress.global_step)
            return HEALED
        loader, in_epoch = run.data.position.active, run.data.in_epoch
        if in_epoch and not loader and not epoch_end:
            self.guard.found = finding  # the loop's own data cannot go back now: at the epoch's end
            return LATER
        stop = self.recovery.act(finding, run.progress.global_step)
        if stop is not None:
            self._stop(stop, 1)
        if not (loader or in_epoch or epoch_end):  # a loop of its own: its data cannot go back at all
            said = f"every rank went back to step {run.progress.global_step} (committed); run the same command again to continue"
            self._stop(Stop(said), EXIT_PREEMPTED)
        run.telemetry.timer.mark()
        return BACK

    def _stop(self, stop: Stop, exit_code: int) -> None:
        self.stop(StopReason.ANOMALY_STOP, None, exit_code, stop.message, commit=stop.commit)

    def _rewound(self, step: int) -> None:
        """A rollback restored `step`: the next step is a whole boundary, snapshots count from `step`."""
        boundary = self.run.boundary
        boundary.reset()
        if boundary.memory is not None:
            boundary.memory.rewound(step)
        self.run.beat("train")

    def _replicated(self) -> List[Tuple[str, torch.Tensor]]:
        model = self.model if self.model is not None else self.run.model  # run.setup's, else the one tracked
        return replicas.replicated(model) if model is not None else []


HEALED, BACK, LATER = "healed", "rolled_back", "later"
