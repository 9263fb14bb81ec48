"""Checkpoints that are either committed and complete, or invisible.

What the files hold is the codec's business (codec.py: the replicated format, rank 0 writes; the
sharded one, every rank writes its own file); where they go is the store's (storage/: a folder, a
bucket). The protocol is the same for every codec and store:
  1. the store stages the save (a folder: `.tmp-step_N-<id>/`) and the files are written into it
     (every byte, size checked; with the sharded format every rank writes and reads back its own
     file in parallel, then reports it to rank 0);
  2. rank 0 builds `manifest.json` (its own digest first, then step, commit sequence, epoch,
     position, world size, training config, size and checksum of every file, each optimizer's
     parameters by name, the codec's own fields) and the store commits: the manifest written last
     (a folder: it, the files not yet durable and the folder fsynced side by side, then renamed to
     `step_N`, atomic); the launcher is checked to be still there right before (an orphaned worker
     never commits); a committed `step_N` already there is moved aside first, never deleted;
  3. the commit made durable (a folder: its parent fsynced), the new checkpoint is read back and
     verified, and only then retention applies, which ranks by step and never removes the
     checkpoint just committed, the newest by step, nor the one a resume would pick (the rule:
     retention.kept, by step and by a monitored metric the manifests record; manifest.expendable).
Step 3 runs in the background thread (for a synchronous save too): the next save, wait() or close()
raises its failure. A power loss before it leaves the new checkpoint committed or invisible and
every older one in place. Resume
(collective) tries the committed checkpoints newest first (by commit sequence): every rank reads
what it needs, verified, and checks it fits the live objects; the first one that every rank could
load is applied. The unusable ones newer than it are moved aside
(`.unusable-step_N-<reason>-<id>`), never deleted.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple, Union

from ..contract.events import Event
from . import manifest as mf
from . import restore as rs
from .codec import Codec, Collectives, Unsaveable, state_of
from .formats import for_state
from .optimizers import manifest_fields as optimizer_fields
from .ranks import RankWrite, SaveHooks, write_files, write_own
from .retention import Policy
from .staging import HostBuffers, Staging, optimizer_owned
from .storage import Store, fileio, store_for
from .storage.base import Batch, FileCheckError, StoreError

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


CheckpointError = rs.CheckpointError
StoreUnavailable = rs.StoreUnavailable


@dataclass
class Restored:
    step: int
    path: str  # where it was restored from: a checkpoint's location in its store, or the snapshots' folder
    manifest: Dict[str, Any]
    memory: bool = False  # from the memory tier's snapshot


class CheckpointManager:
    def __init__(
        self,
        folder: Union[str, Path, Store],
        comm: Collectives,
        keep_last: int,
        training_config: Dict[str, Any],
        on_event: Callable[..., None],
        async_save: bool = False,
        keep_every_n_epochs: Optional[int] = None,
        full_config: Optional[Dict[str, Any]] = None,
        hooks: Optional[SaveHooks] = None,
        defer_optimizer_copy: bool = True,
        keep_best: int = 0,
        monitor: Optional[str] = None,
        mode: str = "min",
    ) -> None:
        self.store = folder if isinstance(folder, Store) else store_for(folder)
        self.comm, self.keep_last = comm, max(1, keep_last)
        self.training_config, self.on_event = training_config, on_event
        self.keep_every_n_epochs = keep_every_n_epochs
        self.retention = Policy(self.keep_last, keep_every_n_epochs, keep_best, monitor, mode)
        self.full_config = full_config or {}
        self.hooks = hooks
        self.async_save, self.defer_optimizer_copy = async_save, defer_optimizer_copy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt")  # writes (async) and read-back checks
        self._pool.submit(fileio.prepare)  # fsync threads started now, not inside the first save
        self._buffers = HostBuffers()
        self._pending: Optional[Future[str]] = None
        self._pending_on_rank_0_only = False  # the pending work is rank 0's alone in a save every rank wrote
        self._written: Optional[RankWrite] = None  # an asynchronous sharded save: written in the background, not committed
        self._objects_of_save: List[Any] = []
        self._copied: Optional[threading.Event] = None  # set once an async save no longer reads live state
        self._hooked: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
        self.last_saved_step: Optional[int] = None
        if comm.rank == 0:
            try:
                self.store.prepare()
            except StoreError as exc:
                raise CheckpointError(str(exc)) from exc

    def where(self, name: str = "") -> str:
        """The location of checkpoint `name` (or of the store): what messages and records name."""
        return self.store.where(name)

    # ---- saving -------------------------------------------------------------------------
    def save(self, step: int, objects: Dict[str, Stateful], per_rank: Dict[str, Stateful], meta: Dict[str, Any]) -> None:
        """Collective: every rank calls it at the same step."""
        clash = sorted(mf.RESERVED & set(meta))
        if clash:
            raise CheckpointError(f"checkpoint meta keys {clash} are reserved for the manifest")
        states = {name: state_of(obj) for name, obj in objects.items()}
        if self.comm.rank == 0:  # who writes the manifest
            meta = {**meta, **optimizer_fields(objects)}
        codec = for_state(states)
        self._objects_of_save = list(objects.values())
        if codec.every_rank_writes:
            self.wait()
        started = time.perf_counter()
        try:
            planned = codec.plan(states, {name: state_of(obj) for name, obj in per_rank.items()}, self.comm)
            problem = None
        except Unsaveable as exc:
            planned, problem = None, f"cannot save {exc.name} at step {step}: {exc.reason}"
        self.last_saved_step = step
        if codec.every_rank_writes:
            self._save_every_rank(step, codec, planned, problem, meta, started)
            return
        if self.comm.rank != 0:
            return
        if problem is not None or planned is None:
            raise CheckpointError(problem)
        self.wait()
        started = time.perf_counter()
        layouts, meta = planned.files, {**meta, **codec.manifest_fields([planned.report])}
        if not self.async_save:
            pieces = {n: layout.buffers() for n, layout in layouts.items()}
            final, files = self._write_and_commit(step, pieces, meta, codec.format, started)
            self._pending = self._pool.submit(self._check_then_retain, step, final, files)
            return
        host = self._stage(layouts, objects.values())
        self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))
        self._pending = self._pool.submit(self._write_staged, step, host, meta, codec.format, started)

    def _save_every_rank(
        self, step: int, codec: Codec, planned: Any, problem: Optional[str], meta: Dict[str, Any], started: float
    ) -> None:
        """A save in which every rank writes its own files (the sharded format), in parallel: each
        writes and reads back its files in the temporary folder and reports them; rank 0 commits
        (`_commit_written`). A failure on any rank fails the save on every rank, with the same
        message. Asynchronous: the files are copied to host memory now, written in the background,
        and committed at a later step boundary at which every rank has written them (`busy`)."""
        comm, staged, unavailable = self.comm, None, False
        if comm.rank == 0 and problem is None:
            try:
                staged = self.store.stage(step)
            except OSError as exc:
                problem, unavailable = f"cannot stage step {step} in {self.where()}: {exc}", isinstance(exc, StoreError)
        name = comm.broadcast_object(staged)
        if name is None:
            problem = problem or "rank 0 could not stage the save"
        writing = RankWrite(step, codec, meta, started, name, problem, unavailable=unavailable)
        if problem is not None or not self.async_save:
            files = (
                {f: layout.buffers() for f, layout in planned.files.items()} if planned is not None and problem is None else {}
            )
            writing.report = write_own(self.store, writing, files, planned, self.comm.rank, self.hooks)
            self._commit_written(writing)
            return
        host = self._stage(planned.files, self._objects_of_save)
        self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))

        def background() -> Dict[str, Any]:
            host.copy_rest()
            return write_own(self.store, writing, {f: host.pieces(f) for f in host.layouts}, planned, self.comm.rank, self.hooks)

        writing.future = self._pool.submit(background)
        self._written = writing

    def busy(self) -> bool:
        """Whether this rank is still writing its files of an asynchronous sharded save."""
        return self._written is not None and (self._written.future is None or not self._written.future.done())

    def written_step(self) -> Optional[int]:
        """The step of the asynchronous sharded save in flight (every rank has the same), or None."""
        return self._written.step if self._written is not None else None

    def commit_written(self) -> None:
        """Collective: commit the asynchronous sharded save in flight (each rank's write waited for)."""
        writing, self._written = self._written, None
        if writing is not None:
            assert writing.future is not None
            writing.report = writing.future.result()
            self._commit_written(writing)

    def _commit_written(self, writing: "RankWrite") -> None:
        comm, step = self.comm, writing.step
        reports = comm.gather_object(writing.report)
        outcome: Optional[Tuple[str, bool]] = None  # (why it failed, whether its store was unavailable)
        if comm.rank == 0:
            staged = writing.tmp
            try:
                failed = [r for r in reports or [] if "error" in r]
                if failed or staged is None:
                    if writing.unavailable or (failed and all(r.get("unavailable") for r in failed)):
                        raise StoreError("; ".join(r["error"] for r in failed) or str(writing.problem))
                    raise CheckpointError("; ".join(r["error"] for r in failed) or str(writing.problem))
                files = {f: spec for r in reports or [] for f, spec in r["files"].items()}
                fields = {**writing.meta, **writing.codec.manifest_fields(reports or [])}
                final = self._commit(step, staged, files, fields, writing.codec.format, self.store.batch())
                self._pending = self._pool.submit(self._check_then_retain, step, final, files, False)
                self._pending_on_rank_0_only = True
                self._saved(step, writing.meta, final, files, writing.started)
            except BaseException as exc:
                if staged is not None:
                    self.store.abandon(staged)
                outcome = (self._failed(step, exc), isinstance(exc, StoreError))
        outcome = comm.broadcast_object(outcome)
        if outcome is not None:
            raise (StoreUnavailable if outcome[1] else CheckpointError)(outcome[0])

    def _stage(self, layouts: Dict[str, Any], objects: Iterable[Any]) -> Staging:
        """The blocking part of an asynchronous save: the host copy (the optimizers' tensors copied
        later, before each optimizer's next step)."""
        optimizers, owned = optimizer_owned(objects) if self.defer_optimizer_copy else ([], None)
        host = Staging(layouts, self._buffers, owned)
        self._copied = host.copied
        for opt in optimizers:
            if opt not in self._hooked:
                self._hooked[opt] = opt.register_step_pre_hook(lambda *_: self.wait_staging())
        return host

    def wait_staging(self) -> None:
        """Block until an asynchronous save no longer reads the live state (an optimizer's step calls it)."""
        copied = self._copied
        if copied is not None:
            copied.wait()

    def wait(self) -> None:
        """Finish a save still being written or checked in the background; its failure stops the run
        here. Collective while an asynchronous sharded save is in flight (it is committed now)."""
        self.commit_written()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            alone, self._pending_on_rank_0_only = self._pending_on_rank_0_only, False
            try:
                pending.result()
            except StoreUnavailable as exc:
                if not alone:
                    raise
                # the read-back of a committed checkpoint of a save every rank wrote, which rank 0 alone
                # waits for: the other ranks go on, so rank 0 must too (retention did not run; it will)
                log.warning("Checkpoint committed but not read back (its store is unavailable): %s", exc)
                self.on_event(Event.CHECKPOINT_FAILED, step=None, error=str(exc))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for handle in list(self._hooked.values()):
                handle.remove()
            self._hooked = weakref.WeakKeyDictionary()
            self._pool.shutdown(wait=True)

    def _write_staged(self, step: int, host: Staging, meta: Dict[str, Any], format: int, started: float) -> str:
        host.copy_rest()
        final, files = self._write_and_commit(step, {name: host.pieces(name) for name in host.layouts}, meta, format, started)
        return self._check_then_retain(step, final, files)

    def _write_and_commit(
        self, step: int, pieces: Dict[str, List[Any]], meta: Dict[str, Any], format: int, started: float
    ) -> Any:
        """Rank 0 writes every file of the save (of a codec in which only it writes: the replicated one)
        and commits it: (name, files)."""
        staged, batch = None, self.store.batch()  # the files made durable with the manifest, together
        try:
            staged = self.store.stage(step)
            files = write_files(self.store, staged, step, pieces, self.hooks, batch)
            final = self._commit(step, staged, files, meta, format, batch)
        except BaseException as exc:
            batch.close()
            if staged is not None:
                self.store.abandon(staged)
            raise (StoreUnavailable if isinstance(exc, StoreError) else CheckpointError)(self._failed(step, exc)) from exc
        self._saved(step, meta, final, files, started)
        return final, files

    def _commit(
        self, step: int, staged: str, files: Dict[str, Dict[str, Any]], fields: Dict[str, Any], format: int, batch: Batch
    ) -> str:
        """Build the manifest of the staged save (its files written, those in `batch` not yet durable)
        and have the store commit it; the committed checkpoint's name. The commit is made durable by
        `_check_then_retain`, before anything older is removed."""
        manifest = {
            "format": format,
            "step": step,
            "commit": mf.next_commit(self.store),
            **fields,
            "world_size": self.comm.world_size,
            "created": time.time(),
            "files": files,
            "config": self.training_config,
            "full_config": self.full_config,
        }
        sealed = mf.seal(manifest)
        where = f"{self.where(staged)}/{mf.MANIFEST}"
        mf.validate(mf.parse(sealed, where), where, step)  # what we write, our reader accepts
        hooks = self.hooks
        fence = (lambda: hooks.before_commit(step)) if hooks is not None else None
        final, replaced = self.store.commit(staged, step, sealed, batch, fence)
        if replaced is not None:
            self._recorded_aside(step, final, replaced, "a new save of the same step replaced it")
        return final

    def _failed(self, step: int, exc: BaseException) -> str:
        try:
            previous = mf.scan(self.store)
            kept = (
                f"the newest committed checkpoint ({previous[0].name}) is intact" if previous else "no earlier checkpoint exists"
            )
        except StoreError:
            kept = "the checkpoints committed before are as they were"
        return f"saving checkpoint step {step} to {self.where()} failed: {type(exc).__name__}: {exc}; {kept}"

    def _saved(self, step: int, meta: Dict[str, Any], final: str, files: Dict[str, Dict[str, Any]], started: float) -> None:
        total = sum(f["bytes"] for f in files.values())
        seconds = time.perf_counter() - started
        self.on_event(
            Event.CHECKPOINT_SAVED,
            step=step,
            epoch=meta.get("epoch"),
            path=self.where(final),
            bytes=total,
            seconds=round(seconds, 4),
        )
        log.info("Checkpoint step %d committed (%.1f MB in %.2f s): %s", step, total / 1e6, seconds, self.where(final))

    def _check_then_retain(self, step: int, final: str, files: Dict[str, Dict[str, Any]], checksums: bool = True) -> str:
        """Read the new checkpoint back before retention may remove anything older (`checksums`: every
        file's too; without, their sizes: each rank read its own files back before it reported them)."""
        try:
            self.store.settle()
            if mf.read_in(self.store, final)["files"] != files:
                raise mf.ManifestError(f"{self.where(final)}/{mf.MANIFEST}: reads back different from what was written")
            problem = rs.verify(self.store, final, checksums)
            if problem:
                raise FileCheckError(problem)
        except StoreError as exc:  # not read back now: nothing known against it, so it stays where it is
            raise StoreUnavailable(f"checkpoint step {step} was committed but could not be read back ({exc})") from exc
        except (ValueError, OSError) as exc:  # ManifestError and FileCheckError are ValueErrors
            moved = self._set_aside(step, final, "readback", str(exc))
            raise CheckpointError(
                f"checkpoint step {step} was written but does not read back the same ({exc}); "
                f"{'it was moved to ' + moved if moved else 'it is left in place'}; "
                "older checkpoints are kept"
            ) from exc
        try:
            self._apply_retention(final)
        except StoreError as exc:
            raise StoreUnavailable(f"checkpoint step {step} committed; retention did not run ({exc})") from exc
        if self.hooks is not None:
            self.hooks.after_commit(step, self.where(final))
        return final

    def _apply_retention(self, just_committed: str) -> None:
        listed = mf.scan(self.store)
        names = {c.path: c.name for c in listed}
        for path in mf.expendable(listed, self.retention, [self.where(just_committed)]):
            self.store.discard(names[path])

    def _set_aside(self, step: Optional[int], name: str, reason: str, error: str) -> Optional[str]:
        try:
            target = self.store.set_aside(name, reason)
        except OSError as exc:
            log.warning("Could not move unusable checkpoint %s aside (%s); leaving it", self.where(name), exc)
            return None
        self._recorded_aside(step, name, target, error)
        return target

    def _recorded_aside(self, step: Optional[int], name: str, target: str, error: str) -> None:
        log.warning("Checkpoint %s moved aside to %s: %s", self.where(name), target, error)
        self.on_event(Event.CHECKPOINT_SET_ASIDE, step=step, path=self.where(name), moved_to=self.where(target), error=error)

    # ---- restoring ----------------------------------------------------------------------
    def restore(
        self,
        objects: Dict[str, Stateful],
        per_rank: Dict[str, Stateful],
        allow_config_change: bool,
        fresh_start_if_unusable: bool = False,
        new_rank: Optional[Callable[[int], None]] = None,
        newest: Optional[int] = None,
        memory: Optional[rs.Tier] = None,
    ) -> Optional[Restored]:
        """Collective: load the newest state that every rank can load into `objects`: the memory tier's
        snapshot (`memory`) when it is newer than every committed checkpoint, else the newest checkpoint
        that verifies; None if there is none.

        A checkpoint saved by another number of workers is refused unless `new_rank` is given (an
        elastic job): then ranks the checkpoint has keep their saved per-rank state, and a rank it
        does not have calls `new_rank(step)` to seed its state deterministically. `newest`: none of a
        later step (a rollback's)."""
        chooser = rs.Chooser(self.store, self.training_config, self.full_config, self.on_event, self._set_aside)
        found = rs.Resume(self.store, self.comm, chooser, memory).run(
            objects, per_rank, allow_config_change, fresh_start_if_unusable, new_rank, newest
        )
        if found is None:
            return None
        if not found.memory:
            self.last_saved_step = found.manifest["step"]
        return Restored(step=found.manifest["step"], path=found.where, manifest=found.manifest, memory=found.memory)


def verify_checkpoint(path: Union[str, Path]) -> Optional[str]:
    """None when the committed checkpoint at `path` (its location) verifies (manifest, sizes, checksums); else why not."""
    return rs.verify_at(path)
