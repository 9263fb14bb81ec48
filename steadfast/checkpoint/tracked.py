"""The run's checkpoints: which objects they hold, the resume, and each save's bookkeeping.

Built on `checkpoint.manager.CheckpointManager` (the commit protocol, verification, fall-back,
retention, asynchronous saves). This adds what a loop needs: the registered objects plus the
loop's progress and every rank's RNG states, the resume policy (`resume=auto|never|must`), the
config-drift guard, a world size that changed since the checkpoint, and the fence that keeps an
orphaned worker (its launcher killed) from committing into a folder a new launch may hold.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Protocol, Tuple, Union

from ..config import Resume, Settings
from ..contract.env import LaunchEnv
from ..contract.events import Event
from ..contract.failures import recurs_when_disk_full
from ..telemetry.records import RunRecord
from . import manifest
from .codec import Collectives
from .finite import nonfinite
from .manager import CheckpointError, CheckpointManager, Restored, StoreUnavailable
from .memory import MemorySnapshots
from .state import Progress, RNGState, is_per_rank, unwrap

log = logging.getLogger(__name__)

RESERVED = ("progress", "ranks", "rng", "telemetry")


class LauncherGone(CheckpointError):
    """The launcher that started this worker is gone: this worker must not commit anything."""


class SaveFaults(Protocol):
    """The faults that fire in a checkpoint's writing (steadfast.faults.FaultInjector: the faults import
    checkpoint/, to damage a committed checkpoint, so it is not imported back)."""

    def during_save(self, step: int, files_written: int) -> None: ...

    def after_commit(self, step: int, path: str) -> None: ...


class _SaveHooks:
    """What the writer calls while it writes: a heartbeat per file, the save faults, the fence."""

    def __init__(self, faults: SaveFaults, beat: Callable[[str], None], launch: LaunchEnv) -> None:
        self.faults, self.beat, self.launch = faults, beat, launch

    def during_save(self, step: int, files_written: int) -> None:
        if threading.current_thread() is threading.main_thread():  # an asynchronous save's thread does not beat:
            self.beat("save")  # if it hangs, training soon waits for it and stops beating
        self.faults.during_save(step, files_written)
        self.before_commit(step)

    def before_commit(self, step: int) -> None:
        if not self.launch.launcher_alive():
            raise LauncherGone(f"the launcher (pid {self.launch.launcher_pid}) is gone; an orphaned worker does not commit")

    def after_commit(self, step: int, path: str) -> None:
        self.faults.after_commit(step, path)


class Checkpointer:
    def __init__(
        self,
        folder: Union[str, Path],
        comm: Collectives,
        settings: Settings,
        resolved_cfg: Dict[str, Any],
        record: RunRecord,
        launch: LaunchEnv,
        faults: SaveFaults,
        beat: Callable[[str], None],
        memory: Optional[MemorySnapshots] = None,
    ) -> None:
        ck = settings.checkpoint
        self.settings, self.comm, self.record = settings, comm, record
        self.manager = CheckpointManager(
            folder,
            comm,
            ck.keep_last,
            manifest.training_config(resolved_cfg, settings.run.safe_to_change),
            record.event,
            async_save=ck.async_save,
            keep_every_n_epochs=ck.keep_every_n_epochs,
            full_config=dict(manifest.flatten(resolved_cfg)),
            hooks=_SaveHooks(faults, beat, launch),
            keep_best=ck.keep_best,
            monitor=ck.monitor,
            mode=ck.mode.value,
        )
        self.monitor = ck.monitor
        # the monitored metric's value given to run.log since the last save, and the step it was logged at:
        # the next save records it (so a value is recorded by one checkpoint at most: the first at or after it)
        self._monitored: Optional[Tuple[Any, int]] = None
        self.objects: Dict[str, Any] = {}
        self.per_rank: Dict[str, Any] = {"rng": RNGState()}
        self.restored: Optional[Restored] = None
        self.memory = memory  # this rank's snapshots in memory (None: off)
        self.source = "disk"  # where the last restore came from
        # asked before each save (collective; steadfast/health/): whether the state the run stands at
        # then is to be committed (an anomaly found may first send it back to a healthy one)
        self.healthy: Callable[[], bool] = lambda: True

    def where(self, step: Optional[int] = None) -> str:
        """Where the checkpoints are (the store's location), or where the checkpoint of `step` is."""
        return self.manager.where(manifest.step_dir_name(step) if step is not None else "")

    @property
    def last_saved_step(self) -> Optional[int]:
        return self.manager.last_saved_step

    def track(self, progress: Progress, objects: Dict[str, Any]) -> None:
        for name, obj in objects.items():
            if name in RESERVED:
                raise ValueError(f"run.resume({name}=...): {name!r} is reserved for the run's own state; use another name")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"run.resume({name}=...): a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                    "checkpointed objects must have both"
                )
            (self.per_rank if is_per_rank(obj) else self.objects)[name] = unwrap(obj)
        self.objects["progress"] = progress

    def logged(self, metrics: Mapping[str, Any], step: int) -> None:
        """Metrics given to run.log at `step`: the monitored one is kept for the next save's manifest."""
        if self.monitor is not None and self.monitor in metrics:
            self._monitored = (metrics[self.monitor], step)

    def best(self) -> Dict[str, Any]:
        """summary.json's fields naming the best committed checkpoint by checkpoint.monitor, and its value
        (null: none has a value yet); {} without a monitor, and on every rank but 0 (it reads the manifests)."""
        if self.monitor is None or self.comm.rank != 0:
            return {}
        found = manifest.best(manifest.scan(self.manager.store), self.manager.retention)
        listed, value = found if found is not None else (None, None)
        return {
            "best_checkpoint": str(listed.path) if listed is not None else None,
            "best_checkpoint_step": listed.step if listed is not None else None,
            "best_checkpoint_value": value,
        }

    def restore(self, new_rank: Optional[Callable[[int], None]]) -> Optional[Restored]:
        """Collective: the newest state that verifies, loaded into the tracked objects: the memory
        tier's, or else a committed checkpoint's (None: a fresh start)."""
        self._monitored = None  # a value logged before describes other weights
        s = self.settings
        if s.resume == Resume.never:
            if manifest.committed(self.manager.store):
                raise CheckpointError(f"resume=never, but {self.where()} already holds checkpoints; they are left untouched")
            return None
        restored = self.manager.restore(
            self.objects, self.per_rank, s.run.allow_config_change, s.run.fresh_start_if_unusable, new_rank, memory=self.memory
        )
        self.source = "memory" if restored is not None and restored.memory else "disk"
        if self.memory is not None and self.source == "disk":  # newer snapshots belong to another timeline
            self.memory.discard_after(restored.step if restored is not None else 0)
        if restored is None and s.resume == Resume.must:
            raise CheckpointError(f"resume=must, but {self.where()} holds no usable checkpoint")
        self.restored = restored
        return restored

    def roll_back(self, newest: int) -> Optional[Restored]:
        """Collective: the newest state at or before step `newest` loaded into the tracked objects: a
        snapshot in memory, or else the newest committed checkpoint at or before it (None: there is
        neither). Snapshots newer than the state restored are discarded (another timeline)."""
        self.manager.wait()  # an asynchronous save in flight reads the live state, and may commit a checkpoint
        self._monitored = None  # logged on the timeline left behind
        s = self.settings
        restored = self.manager.restore(self.objects, self.per_rank, s.run.allow_config_change, newest=newest, memory=self.memory)
        self.source = "memory" if restored is not None and restored.memory else "disk"
        if restored is not None and self.memory is not None:
            self.memory.discard_after(restored.step)
        return restored

    def save(self, progress: Progress) -> float:
        """Collective: commit the tracked state at the current step; returns the seconds training waited.
        A state whose parameters or optimizer state hold a NaN or an infinity on any rank is refused.
        Nothing is committed when `healthy()` says so (then 0.0)."""
        if not self.healthy():
            return 0.0
        started = time.perf_counter()
        poisoned = nonfinite(self.objects)
        if self.comm.max_each([1.0 if poisoned else 0.0])[0]:
            where = poisoned or "another rank's state"
            raise CheckpointError(
                f"refusing to commit step {progress.global_step}: {where} holds a NaN or an infinity; "
                f"the newest committed checkpoint in {self.where()} is kept"
            )
        meta: Dict[str, Any] = {
            "epoch": progress.epoch,
            "batch_in_epoch": progress.batch_in_epoch,
            "sample_in_epoch": progress.sample_in_epoch,
        }
        if self.monitor is not None:
            meta[manifest.METRIC] = manifest.metric_field(self.monitor, *(self._monitored or (None, None)))
        with self._unless_unavailable(progress.global_step), recurs_when_disk_full("a checkpoint save"):
            # a restart would find the disk as full; an unreachable store, maybe not
            self.manager.save(progress.global_step, self.objects, self.per_rank, meta)
        self._monitored = None
        return time.perf_counter() - started

    def commit_written(self) -> None:
        """Collective: commit the asynchronous sharded save every rank has written (the step boundary's)."""
        with self._unless_unavailable(self.manager.written_step()):
            self.manager.commit_written()

    @contextmanager
    def _unless_unavailable(self, step: Optional[int]) -> Iterator[None]:
        """A save its store could not take (unreachable, after the client's retries: StoreUnavailable)
        does not stop training: it is logged and recorded (checkpoint_failed), the newest committed
        checkpoint stays as it was, and the next save due tries again. Every rank sees the same
        outcome (rank 0's alone where only rank 0 writes)."""
        try:
            yield
        except StoreUnavailable as exc:
            log.warning("Checkpoint not saved, training goes on and the next save tries again: %s", exc)
            self.record.event(Event.CHECKPOINT_FAILED, step=step, error=str(exc))

    def close(self) -> None:
        with (
            self._unless_unavailable(None),
            recurs_when_disk_full("a checkpoint save"),
        ):  # an asynchronous save's writing ends here
            self.manager.close()
