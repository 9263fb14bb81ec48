"""Checkpoints that are either committed and complete, or invisible.

What the files hold is the codec's business (codec.py: the replicated format, rank 0 writes; the
sharded one, every rank writes its own file). The protocol is the same for both:
  1. write the files into `.tmp-step_N-<id>/` (every byte, size checked; with the sharded format
     every rank writes, fsyncs and reads back its own file in parallel, then reports it to rank 0);
  2. rank 0 writes `manifest.json` last (its own digest first, then step, commit sequence, epoch,
     position, world size, training config, size and checksum of every file, each optimizer's
     parameters by name, the codec's own fields), then fsyncs it, the files not yet durable and the
     folder, side by side (fileio.Unsynced);
  3. checks the launcher is still there (an orphaned worker never commits), renames the folder to
     `step_N` (atomic); a committed `step_N` already there is moved aside first, never deleted;
  4. fsyncs the parent (the rename durable), reads the new checkpoint back and verifies it, and only
     then applies retention, which ranks by step (and by a monitored metric the manifests record) and
     never removes the checkpoint just committed, the newest by step, nor the one a resume would pick
     (the rule: retention.kept; the folders it leaves out: manifest.expendable).
Step 4 runs in the background thread (for a synchronous save too): the next save, wait() or close()
raises its failure. A power loss before it leaves the new checkpoint committed or invisible (the
rename is atomic; its files were durable before it) and every older one in place. Resume
(collective) tries the committed checkpoints newest first (by commit sequence): every rank reads
what it needs, verified, and checks it fits the live objects; the first one that every rank could
load is applied. The unusable ones newer than it are moved aside
(`.unusable-step_N-<reason>-<id>`), never deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

from ..contract.events import Event
from . import fileio
from . import manifest as mf
from . import restore as rs
from .codec import Codec, Collectives, Unsaveable, state_of
from .formats import for_state
from .optimizers import manifest_fields as optimizer_fields
from .ranks import RankWrite, SaveHooks, write_own
from .retention import Policy
from .snapshot import HostBuffers, Snapshot, optimizer_owned

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


CheckpointError = rs.CheckpointError


@dataclass
class Restored:
    step: int
    path: Path
    manifest: Dict[str, Any]


class CheckpointManager:
    def __init__(
        self,
        folder: Path,
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
        self.folder, self.comm, self.keep_last = Path(folder), comm, max(1, keep_last)
        self.training_config, self.on_event = training_config, on_event
        self.keep_every_n_epochs = keep_every_n_epochs
        self.retention = Policy(self.keep_last, keep_every_n_epochs, keep_best, monitor, mode)
        self.full_config = full_config or {}
        self.hooks = hooks
        self.async_save, self.defer_optimizer_copy = async_save, defer_optimizer_copy
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt")  # writes (async) and read-back checks
        self._pool.submit(fileio.prepare)  # threads started now, not inside the first save
        self._buffers = HostBuffers()
        self._pending: Optional[Future[Path]] = None
        self._written: Optional[RankWrite] = None  # an asynchronous sharded save: written in the background, not committed
        self._objects_of_save: List[Any] = []
        self._copied: Optional[threading.Event] = None  # set once an async save no longer reads live state
        self._hooked: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
        self.last_saved_step: Optional[int] = None
        if comm.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_writable()
            self._remove_leftovers()

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
        layouts = planned.files
        if not self.async_save:
            final, files = self._write_and_commit(step, {n: layout.buffers() for n, layout in layouts.items()}, meta, started)
            self._pending = self._pool.submit(self._check_then_retain, step, final, files)
            return
        snap = self._snapshot(layouts, objects.values())
        self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))
        self._pending = self._pool.submit(self._write_snapshot, step, snap, meta, started)

    def _save_every_rank(
        self, step: int, codec: Codec, planned: Any, problem: Optional[str], meta: Dict[str, Any], started: float
    ) -> None:
        """A save in which every rank writes its own files (the sharded format), in parallel: each
        writes and reads back its files in the temporary folder and reports them; rank 0 commits
        (`_commit_written`). A failure on any rank fails the save on every rank, with the same
        message. Asynchronous: the files are copied to host memory now, written in the background,
        and committed at a later step boundary at which every rank has written them (`busy`)."""
        comm, tmp = self.comm, None
        if comm.rank == 0 and problem is None:
            tmp = self.folder / f"{mf.TMP_PREFIX}{mf.step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir()
            except OSError as exc:
                tmp, problem = None, f"cannot create {tmp}: {exc}"
        name = comm.broadcast_object(tmp.name if tmp is not None else None)
        if name is None:
            problem = problem or "rank 0 could not create the temporary folder"
        writing = RankWrite(step, codec, meta, started, name, problem)
        if problem is not None or not self.async_save:
            files = (
                {f: layout.buffers() for f, layout in planned.files.items()} if planned is not None and problem is None else {}
            )
            writing.report = write_own(self.folder, writing, files, planned, self.comm.rank, self.hooks)
            self._commit_written(writing)
            return
        snap = self._snapshot(planned.files, self._objects_of_save)
        self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))

        def background() -> Dict[str, Any]:
            snap.copy_rest()
            return write_own(self.folder, writing, {f: snap.pieces(f) for f in snap.layouts}, planned, self.comm.rank, self.hooks)

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
        outcome: Optional[str] = None
        if comm.rank == 0:
            tmp = self.folder / writing.tmp if writing.tmp else None
            try:
                errors = [r["error"] for r in reports or [] if "error" in r]
                if errors or tmp is None:
                    raise CheckpointError("; ".join(errors) or str(writing.problem))
                files = {f: spec for r in reports or [] for f, spec in r["files"].items()}
                fields = {**writing.meta, **writing.codec.manifest_fields(reports or [])}
                final = self._commit(step, tmp, files, fields, writing.codec.format)
                self._pending = self._pool.submit(self._check_then_retain, step, final, files, False)
                self._saved(step, writing.meta, final, files, writing.started)
            except BaseException as exc:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                outcome = self._failed(step, exc)
        outcome = comm.broadcast_object(outcome)
        if outcome is not None:
            raise CheckpointError(outcome)

    def _snapshot(self, layouts: Dict[str, Any], objects: Iterable[Any]) -> Snapshot:
        """The blocking part of an asynchronous save: the host copy (the optimizers' tensors copied
        later, before each optimizer's next step)."""
        optimizers, owned = optimizer_owned(objects) if self.defer_optimizer_copy else ([], None)
        snap = Snapshot(layouts, self._buffers, owned)
        self._copied = snap.copied
        for opt in optimizers:
            if opt not in self._hooked:
                self._hooked[opt] = opt.register_step_pre_hook(lambda *_: self.wait_snapshot())
        return snap

    def wait_snapshot(self) -> None:
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
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for handle in list(self._hooked.values()):
                handle.remove()
            self._hooked = weakref.WeakKeyDictionary()
            self._pool.shutdown(wait=True)

    def _write_snapshot(self, step: int, snap: Snapshot, meta: Dict[str, Any], started: float) -> Path:
        snap.copy_rest()
        final, files = self._write_and_commit(step, {name: snap.pieces(name) for name in snap.layouts}, meta, started)
        return self._check_then_retain(step, final, files)

    def _write_and_commit(
        self, step: int, pieces: Dict[str, List[Any]], meta: Dict[str, Any], started: float
    ) -> Tuple[Path, Dict[str, Dict[str, Any]]]:
        """Rank 0 writes every file of the save and commits it (the replicated format)."""
        tmp = self.folder / f"{mf.TMP_PREFIX}{mf.step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        files: Dict[str, Dict[str, Any]] = {}
        unsynced = fileio.Unsynced()  # made durable with the manifest, together
        try:
            tmp.mkdir()
            for name, parts in pieces.items():
                size, digest = fileio.write_file(tmp / name, parts, later=unsynced)
                files[name] = {"bytes": size, "checksum": digest}
                if self.hooks is not None:
                    self.hooks.during_save(step, len(files))
            final = self._commit(step, tmp, files, meta, mf.FORMAT, unsynced)
        except BaseException as exc:
            unsynced.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._failed(step, exc)) from exc
        self._saved(step, meta, final, files, started)
        return final, files

    def _commit(
        self,
        step: int,
        tmp: Path,
        files: Dict[str, Dict[str, Any]],
        fields: Dict[str, Any],
        format: int,
        unsynced: Optional[fileio.Unsynced] = None,
    ) -> Path:
        """Write the manifest into `tmp` (its files written, those in `unsynced` not yet durable), make
        them all and the folder durable, and rename it to the step's folder. The rename is made durable
        by `_check_then_retain`, before anything older is removed."""
        final = self.folder / mf.step_dir_name(step)
        manifest = {
            "format": format,
            "step": step,
            "commit": mf.next_commit(self.folder),
            **fields,
            "world_size": self.comm.world_size,
            "created": time.time(),
            "files": files,
            "config": self.training_config,
            "full_config": self.full_config,
        }
        sealed = mf.seal(manifest)
        mf.validate(mf.parse(sealed, tmp / mf.MANIFEST), tmp / mf.MANIFEST, step)  # what we write, our reader accepts
        unsynced = unsynced or fileio.Unsynced()
        fileio.write_file(tmp / mf.MANIFEST, [sealed], later=unsynced)
        unsynced.sync(tmp)
        if self.hooks is not None:
            self.hooks.before_commit(step)  # the orphan fence, right before the rename that commits
        if os.path.lexists(final):  # an earlier crash's leftover, or a checkpoint of this step from before
            self._move_out_of_the_way(step, final)
        os.rename(tmp, final)
        return final

    def _failed(self, step: int, exc: BaseException) -> str:
        previous = mf.committed(self.folder)
        kept = (
            f"the newest committed checkpoint ({previous[0][1].name}) is intact" if previous else "no earlier checkpoint exists"
        )
        return f"saving checkpoint step {step} to {self.folder} failed: {type(exc).__name__}: {exc}; {kept}"

    def _saved(self, step: int, meta: Dict[str, Any], final: Path, files: Dict[str, Dict[str, Any]], started: float) -> None:
        total = sum(f["bytes"] for f in files.values())
        seconds = time.perf_counter() - started
        self.on_event(
            Event.CHECKPOINT_SAVED, step=step, epoch=meta.get("epoch"), path=str(final), bytes=total, seconds=round(seconds, 4)
        )
        log.info("Checkpoint step %d committed (%.1f MB in %.2f s): %s", step, total / 1e6, seconds, final)

    def _check_then_retain(self, step: int, final: Path, files: Dict[str, Dict[str, Any]], checksums: bool = True) -> Path:
        """Read the new checkpoint back before retention may remove anything older (`checksums`: every
        file's too; without, their sizes: each rank read its own files back before it reported them)."""
        try:
            fileio.fsync_dir(self.folder)  # the rename that committed it, durable
            if mf.read(final)["files"] != files:
                raise mf.ManifestError(f"{final / mf.MANIFEST}: reads back different from what was written")
            problem = rs.verify(final, checksums)
            if problem:
                raise fileio.FileCheckError(problem)
        except (ValueError, OSError) as exc:  # ManifestError and FileCheckError are ValueErrors
            moved = self._set_aside(step, final, "readback", str(exc))
            raise CheckpointError(
                f"checkpoint step {step} was written but does not read back the same ({exc}); "
                f"{'it was moved to ' + moved.name if moved else 'it is left in place'}; "
                "older checkpoints are kept"
            ) from exc
        self._apply_retention(final)
        if self.hooks is not None:
            self.hooks.after_commit(step, final)
        return final

    def _apply_retention(self, just_committed: Path) -> None:
        for path in mf.expendable(mf.scan(self.folder), self.retention, [just_committed]):
            self._discard(path)
        self._remove_leftovers(only_trash=True)

    def _move_out_of_the_way(self, step: int, final: Path) -> None:
        if os.path.lexists(final / mf.MANIFEST):  # committed (usable or not): kept, under another name
            self._set_aside(step, final, "replaced", "a new save of the same step replaced it")
        else:  # no manifest: the leftover of a crash, never committed
            final.rename(self.folder / f"{mf.TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")

    def _set_aside(self, step: Optional[int], path: Path, reason: str, error: str) -> Optional[Path]:
        target = self.folder / mf.set_aside_name(path, reason)
        try:
            path.rename(target)
        except OSError as exc:
            log.warning("Could not move unusable checkpoint %s aside (%s); leaving it", path, exc)
            return None
        log.warning("Checkpoint %s moved aside to %s: %s", path, target.name, error)
        self.on_event(Event.CHECKPOINT_SET_ASIDE, step=step, path=str(path), moved_to=str(target), error=error)
        return target

    def _discard(self, path: Path) -> None:
        trash = self.folder / f"{mf.TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        path.rename(trash)  # invisible at once, even if the removal below is interrupted
        shutil.rmtree(trash, ignore_errors=True)

    def _remove_leftovers(self, only_trash: bool = False) -> None:
        prefixes = (mf.TRASH_PREFIX,) if only_trash else (mf.TRASH_PREFIX, mf.TMP_PREFIX)
        for child in self.folder.iterdir():
            if child.name.startswith(prefixes):
                log.info("Removing leftover %s", child)
                shutil.rmtree(child, ignore_errors=True)

    def _check_writable(self) -> None:
        probe = self.folder / f"{mf.TMP_PREFIX}probe-{os.getpid()}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(f"checkpoint folder {self.folder} is not writable: {exc}") from exc

    # ---- restoring ----------------------------------------------------------------------
    def restore(
        self,
        objects: Dict[str, Stateful],
        per_rank: Dict[str, Stateful],
        allow_config_change: bool,
        fresh_start_if_unusable: bool = False,
        new_rank: Optional[Callable[[int], None]] = None,
        newest: Optional[int] = None,
    ) -> Optional[Restored]:
        """Collective: load the newest checkpoint that every rank can load into `objects`; None if there is none.

        A checkpoint saved by another number of workers is refused unless `new_rank` is given (an
        elastic job): then ranks the checkpoint has keep their saved per-rank state, and a rank it
        does not have calls `new_rank(step)` to seed its state deterministically. `newest`: none of a
        later step (a rollback's)."""
        chooser = rs.Chooser(self.folder, self.training_config, self.full_config, self.on_event, self._set_aside)
        found = rs.Resume(self.folder, self.comm, chooser).run(
            objects, per_rank, allow_config_change, fresh_start_if_unusable, new_rank, newest
        )
        if found is None:
            return None
        path, manifest = found
        self.last_saved_step = manifest["step"]
        return Restored(step=manifest["step"], path=path, manifest=manifest)


def verify_checkpoint(path: Path) -> Optional[str]:
    """None when the committed checkpoint at `path` verifies (manifest, sizes, checksums); else why not."""
    return rs.verify(path)
