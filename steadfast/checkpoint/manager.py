"""Checkpoints that are either committed and complete, or invisible.

What the files hold is the codec's business (codec.py: the replicated format, rank 0 writes; the
sharded one, every rank writes its own file); where they go is the store's (storage/: a folder, a
bucket). The protocol is the same for every codec and store:
  1. the codec's plan says which ranks write which files (the replicated format: rank 0 all of
     them; the sharded one: every rank its own); rank 0 stages the save (a folder:
     `.tmp-step_N-<id>/`) and each rank with files writes them into it (every byte, size checked;
     where every rank writes, each reads back its own file, in parallel, and reports it to rank 0);
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
from ._commits import Commits
from ._sealer import Sealer
from .codec import Collectives, Unsaveable, state_of
from .formats import for_state
from .optimizers import ParamNames
from .ranks import RankWrite, SaveHooks, write_own
from .retention import Policy
from .reuse import SMALL, Plans
from .staging import HostBuffers, Owned, Staging, optimizer_owned
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
        # the configs are the same in every manifest it writes: encoded once (they are most of its bytes)
        self._sealer = Sealer({"config": self.training_config, "full_config": self.full_config})
        self.hooks = hooks
        self.async_save, self.defer_optimizer_copy = async_save, defer_optimizer_copy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt")  # writes (async) and read-back checks
        # its thread and the fsync threads started, and idle, before this returns: not in the first save
        self._pool.submit(fileio.prepare).result()
        self._buffers = HostBuffers()
        # a synchronous save builds its file's header on this thread, and a reused layout keeps it: worth
        # the structure's walk however small the state (B's 25 tensors: ~0.1 CPU ms a save less); an
        # asynchronous save builds it in the background, so a small state is planned anew there, unwalked
        self.plans = Plans(small=SMALL if async_save else 0)
        self._param_names = ParamNames()  # the optimizers' parameters by name, kept while the modules keep them
        self._pending: Optional[Future[Optional[str]]] = None
        self._pending_on_rank_0_only = False  # the pending work is rank 0's alone in a save every rank wrote
        self._written: Optional[RankWrite] = None  # an asynchronous sharded save: written in the background, not committed
        self._copied: Optional[threading.Event] = None  # set once an async save no longer reads live state
        self._hooked: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
        self.last_saved_step: Optional[int] = None
        self._commits = Commits(self.store)  # the next commit's number, without reading every manifest each save
        if comm.rank == 0:
            try:
                self.store.prepare()
            except StoreError as exc:
                raise CheckpointError(str(exc)) from exc
            try:
                self._commits.listed(mf.scan(self.store))  # known now: the first save lists names, reads no manifest
            except StoreError:
                pass  # the first save scans

    def where(self, name: str = "") -> str:
        """The location of checkpoint `name` (or of the store): what messages and records name."""
        return self.store.where(name)

    # ---- saving -------------------------------------------------------------------------
    def save(self, step: int, objects: Dict[str, Stateful], per_rank: Dict[str, Stateful], meta: Dict[str, Any]) -> None:
        """Collective: every rank calls it at the same step.

        One protocol for every codec; the codec's plan says which ranks write files. Rank 0 stages the
        save, each rank that has files writes them (`_write`: ranks.write_files, the one file loop),
        rank 0 commits from every writer's report (`_commit_written`), and a failure anywhere abandons
        the staged save and fails it with one message. The one policy is who wrote:
          - rank 0 alone (the replicated format: the others' plan is empty, so they return once
            planned): it stages in its writer, its files become durable with the manifest, and its own
            report is the only one: no collective beyond the plan's. Asynchronous: write and commit run
            in the background at once, the loop blocked only for the host copy.
          - every rank (the sharded format): rank 0 stages and tells every rank the name (a broadcast),
            each file is durable and read back before it is reported, and rank 0 gathers the reports and
            tells every rank the outcome (a gather, a broadcast). Asynchronous: written in the
            background, committed at a later step boundary by which every rank has written (`busy`,
            `written_step`, `commit_written`)."""
        clash = sorted(mf.RESERVED & set(meta))
        if clash:
            raise CheckpointError(f"checkpoint meta keys {clash} are reserved for the manifest")
        states = {name: state_of(obj) for name, obj in objects.items()}
        if self.comm.rank == 0:  # who writes the manifest
            meta = {**meta, **self._param_names.fields(objects)}
        codec = for_state(states)
        codec.plans = self.plans  # the last save's layouts, reused while the state keeps its structure
        started = time.perf_counter()
        staged = self.async_save and self.defer_optimizer_copy and not codec.every_rank_writes and self.comm.rank == 0
        optimizers, owned = optimizer_owned(objects.values()) if staged else ([], None)
        # the optimizers' tensors' layout is checked in the background, before they are copied (reuse.py)
        self.plans.owned = owned.ids if owned is not None else None
        try:
            planned = codec.plan(states, {name: state_of(obj) for name, obj in per_rank.items()}, self.comm)
            problem = None
        except Unsaveable as exc:
            planned, problem = None, f"cannot save {exc.name} at step {step}: {exc.reason}"
        finally:
            self.plans.owned = None
        self.last_saved_step = step
        alone = not codec.every_rank_writes
        if alone and self.comm.rank != 0:
            return  # it has no files: rank 0 writes and commits the save without it
        waited = time.perf_counter()
        self.wait()  # collective while a save of every rank is written and not committed
        started += time.perf_counter() - waited
        if alone and problem is not None:
            raise CheckpointError(problem)
        writing = RankWrite(step, codec, meta, started, planned, alone, problem=problem)
        writing.batch = self.store.batch() if alone else None
        if not alone:
            self._stage_save(writing)
        if writing.problem is not None or not self.async_save:
            files = planned.files if planned is not None and writing.problem is None else {}
            self._write(writing, {f: layout.buffers() for f, layout in files.items()})
            self._check_later(writing, self._commit_written(writing))
            return
        assert planned is not None
        host = self._stage(planned.files, objects.values(), optimizers, owned)
        self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))
        future = self._pool.submit(self._write_staged, writing, host)
        if alone:
            self._pending = future  # committed in the background, as soon as it is written
        else:
            writing.future, self._written = future, writing

    def _stage_save(self, writing: RankWrite) -> None:
        """Rank 0 stages the save; unless it writes alone, every rank is told the name (collective)."""
        if self.comm.rank == 0 and writing.problem is None:
            try:
                writing.tmp = self.store.stage(writing.step)
            except Exception as exc:
                writing.problem = f"cannot stage step {writing.step} in {self.where()}: {exc}"
                writing.unavailable, writing.failure = isinstance(exc, StoreError), exc
        if not writing.alone:
            writing.tmp = self.comm.broadcast_object(writing.tmp)
            if writing.tmp is None:
                writing.problem = writing.problem or "rank 0 could not stage the save"

    def _write(self, writing: RankWrite, pieces: Dict[str, List[Any]]) -> None:
        """This rank's files written into the staged save (staged first by rank 0 writing alone), reported."""
        if writing.alone:
            self._stage_save(writing)
        writing.report = write_own(self.store, writing, pieces, self.comm.rank, self.hooks)

    def _write_staged(self, writing: RankWrite, host: Staging) -> Optional[str]:
        """The background part of an asynchronous save: the rest of the host copy, this rank's files
        written; rank 0 writing alone commits and reads back at once (the committed name)."""
        try:
            host.copy_rest()
        except TypeError as exc:  # a tensor's dtype changed to one a checkpoint cannot store (reuse.placed_anew)
            raise CheckpointError(f"cannot save step {writing.step}: {exc}") from exc
        self._write(writing, {name: host.pieces(name) for name in host.layouts})
        if not writing.alone:
            return None  # committed at a step boundary by which every rank has written (commit_written)
        committed = self._commit_written(writing)
        assert committed is not None
        return self._check_then_retain(writing.step, *committed)

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
            writing.future.result()
            self._check_later(writing, self._commit_written(writing))

    def _commit_written(self, writing: RankWrite) -> Optional[Tuple[str, Dict[str, Dict[str, Any]]]]:
        """Rank 0 commits the save from every writer's report (its own the only one when it wrote alone:
        no collective); the committed name and files on rank 0. A failure abandons the staged save and
        raises StoreUnavailable (its store unreachable) or CheckpointError, on every rank that wrote."""
        comm, step = self.comm, writing.step
        reports = [writing.report] if writing.alone else comm.gather_object(writing.report)
        outcome: Optional[Tuple[str, bool]] = None  # (why it failed, whether its store was unavailable)
        cause: Optional[BaseException] = None
        committed = None
        if comm.rank == 0:
            staged = writing.tmp
            try:
                if writing.alone and writing.failure is not None:
                    raise writing.failure
                failed = [r for r in reports or [] if "error" in r]
                if failed or staged is None:
                    if writing.unavailable or (failed and all(r.get("unavailable") for r in failed)):
                        raise StoreError("; ".join(r["error"] for r in failed) or str(writing.problem))
                    raise CheckpointError("; ".join(r["error"] for r in failed) or str(writing.problem))
                files = {f: spec for r in reports or [] for f, spec in r["files"].items()}
                fields = {**writing.meta, **writing.codec.manifest_fields(reports or [])}
                committed = (
                    self._commit(step, staged, files, fields, writing.codec.format, writing.batch or self.store.batch()),
                    files,
                )
            except BaseException as exc:
                self._commits.forget()  # whether it was committed is not known here
                if writing.batch is not None:
                    writing.batch.close()
                if staged is not None:
                    self.store.abandon(staged)
                outcome, cause = (self._failed(step, exc), isinstance(exc, StoreError)), exc
        if not writing.alone:
            outcome = comm.broadcast_object(outcome)
        if outcome is not None:
            raise (StoreUnavailable if outcome[1] else CheckpointError)(outcome[0]) from cause
        if committed is not None:
            self._saved(step, writing.meta, *committed, writing.started)
        return committed

    def _check_later(self, writing: RankWrite, committed: Optional[Tuple[str, Dict[str, Dict[str, Any]]]]) -> None:
        """Rank 0 reads the committed save back in the background (checksums too when it wrote every
        file; else sizes: each writer read its own back). Where every rank wrote, the others go on."""
        if committed is not None:
            self._pending = self._pool.submit(self._check_then_retain, writing.step, *committed, writing.alone)
            self._pending_on_rank_0_only = not writing.alone

    def _stage(self, layouts: Dict[str, Any], objects: Iterable[Any], optimizers: List[Any], owned: Optional[Owned]) -> Staging:
        """The blocking part of an asynchronous save: the host copy (the optimizers' tensors copied
        later, before each optimizer's next step; `owned`: what the plan was told of them, if anything)."""
        if owned is None and self.defer_optimizer_copy:
            optimizers, owned = optimizer_owned(objects)
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

    def _commit(
        self, step: int, staged: str, files: Dict[str, Dict[str, Any]], fields: Dict[str, Any], format: int, batch: Batch
    ) -> str:
        """Build the manifest of the staged save (its files written, those in `batch` not yet durable)
        and have the store commit it; the committed checkpoint's name. The commit is made durable by
        `_check_then_retain`, before anything older is removed."""
        commit = self._commits.next()
        manifest = {
            "format": format,
            "step": step,
            "commit": commit,
            **fields,
            "world_size": self.comm.world_size,
            "created": time.time(),
            "files": files,
        }  # then the configs (the sealer's)
        sealed = self._sealer.seal(manifest, f"{self.where(staged)}/{mf.MANIFEST}", step)  # validated as read back
        hooks = self.hooks
        fence = (lambda: hooks.before_commit(step)) if hooks is not None else None
        final, replaced = self.store.commit(staged, step, sealed, batch, fence)
        self._commits.committed(final, commit)  # the one it replaced was set aside under a name nothing lists
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
        path = self.where(final)
        self.on_event(
            Event.CHECKPOINT_SAVED, step=step, epoch=meta.get("epoch"), path=path, bytes=total, seconds=round(seconds, 4)
        )
        log.info("Checkpoint step %d committed (%.1f MB in %.2f s): %s", step, total / 1e6, seconds, path)

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
        self._commits.listed(listed)
        names = {c.path: c.name for c in listed}
        for path in mf.expendable(listed, self.retention, [self.where(just_committed)]):
            self._commits.removed(names[path])
            self.store.discard(names[path])

    def _set_aside(self, step: Optional[int], name: str, reason: str, error: str) -> Optional[str]:
        self._commits.forget()
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
