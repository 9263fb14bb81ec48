"""How a run stops on purpose: every rank at the same step commits it (unless the state is not known
healthy), records why, and ends the task with `StopRun` (a preemption, the memory limit, too many
anomalies). What `steadfast.Run` does at a stop, apart from the façade."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, NoReturn, Optional

from ..checkpoint.state import Progress
from ..checkpoint.tracked import Checkpointer
from ..contract.events import Event
from ..contract.exits import EXIT_PREEMPTED
from ..contract.stop import PREEMPTED, StopRun, signal_name, stop_requested_at
from ..telemetry.metrics import Telemetry
from ..telemetry.records import RunRecord
from .agreement import StopAgreement
from .shape import LoopShape

log = logging.getLogger("steadfast")


class Stops:
    def __init__(
        self,
        progress: Progress,
        agreement: StopAgreement,
        checkpointer: Checkpointer,
        telemetry: Telemetry,
        record: RunRecord,
        shape: LoopShape,
        save: Callable[[], None],
        result: Callable[[], Dict[str, Any]],
        close: Callable[[], None],
    ) -> None:
        self.progress, self.agreement, self.checkpointer, self.telemetry = progress, agreement, checkpointer, telemetry
        self.record, self.shape, self.save, self.result, self.close = record, shape, save, result, close

    def commit_last(self, commit: bool = True) -> None:
        """Every rank: the step it stands at committed (unless `commit` is False: a state not known
        healthy; an asynchronous save's too, before anyone reports it), the last metrics windows sent."""
        self.agreement.drain(self.progress.global_step)
        if commit and self.checkpointer.last_saved_step != self.progress.global_step:
            self.save()
        self.checkpointer.close()
        self.telemetry.close()

    def preempt(self, signum: int) -> NoReturn:
        where = self.shape.where()
        self.stop(
            PREEMPTED,
            signum,
            EXIT_PREEMPTED,
            f"{signal_name(signum)}: stopped at step {self.progress.global_step}"
            + ("" if where.startswith("step") else f" ({where})")
            + ", checkpoint committed. Run the same command again to continue.",
        )

    def stop(
        self, reason: str, signum: Optional[int], exit_code: int, message: str, commit: bool = True, **fields: Any
    ) -> NoReturn:
        """Every rank, at the same step: commit it (unless `commit` is False: a state not known healthy),
        record the stop, and end the task with StopRun. (The step committed is the healthy one an
        anomaly found at this save sent the run back to.)"""
        self.commit_last(commit)
        p = self.progress
        saved = self.checkpointer.last_saved_step == p.global_step
        fields.update(
            step=p.global_step,
            epoch=p.epoch,
            batch_in_epoch=p.batch_in_epoch,
            saved=saved,
            message=message,
            checkpoint=self.checkpointer.where(p.global_step) if saved else None,
            result=self.result(),
        )
        if reason == PREEMPTED:
            asked = stop_requested_at()
            fields.update(signal=signal_name(signum), signal_number=signum)
            if asked is not None:
                fields["signal_to_commit_s"] = round(time.time() - asked, 3)
        self.record.event(Event(reason), **fields)
        log.warning("%s", message)
        self.close()
        raise StopRun(reason, p.global_step, saved, message, exit_code, signum)
