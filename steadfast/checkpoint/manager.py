"""Checkpoints that are either committed and complete, or invisible.

Save (rank 0 writes; every rank contributes its own RNG state):
  1. write every object's file into `.tmp-step_N-<id>/`, fsync each;
  2. write `manifest.json` last (step, epoch, position, world size, training config, size and
     checksum of every file), fsync it and the folder;
  3. rename the folder to `step_N` (atomic) and fsync the parent; a leftover `step_N` from an
     earlier crash is moved aside first and removed after;
  4. only then apply retention, which never touches the newest committed checkpoint.
Resume takes the newest committed step that verifies (sizes, checksums, parse), falling back
to older ones and saying why; files are read without unpickling anything (see tensorfile).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch

from . import manifest as mf
from . import tensorfile
from ..comm import Comm
from ..contract.events import Event

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the message names the file and the cause."""


@dataclass
class Restored:
    step: int
    path: Path
    manifest: Dict[str, Any]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HostSnapshot:
    """Copies of the state in host memory, reused from one asynchronous save to the next.

    Fresh allocations cost more than the copy itself (page faults); the buffers are free to reuse
    because a new snapshot is only taken after the previous save has been written.
    """

    def __init__(self) -> None:
        self.buffers: List[torch.Tensor] = []

    def copy(self, tree: Any) -> Any:
        self._next = 0
        out = self._copy(tree)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land first
        return out

    def _copy(self, tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            i, self._next = self._next, self._next + 1
            src = tree.detach()
            if i == len(self.buffers):
                self.buffers.append(torch.empty(0))
            buf = self.buffers[i]
            if buf.shape != src.shape or buf.dtype != src.dtype:
                buf = self.buffers[i] = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            return buf.copy_(src, non_blocking=src.is_cuda)
        if isinstance(tree, dict):
            return {k: self._copy(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(v) for v in tree)
        return tree


class CheckpointManager:
    def __init__(
        self,
        folder: Path,
        comm: Comm,
        keep_last: int,
        training_config: Dict[str, Any],
        on_event: Callable[..., None],
        async_save: bool = False,
        keep_every_n_epochs: Optional[int] = None,
        full_config: Optional[Dict[str, Any]] = None,
        hooks: Any = None,
    ) -> None:
        self.folder, self.comm, self.keep_last = folder, comm, keep_last
        self.training_config, self.on_event = training_config, on_event
        self.keep_every_n_epochs = keep_every_n_epochs
        self.full_config = full_config or {}
        self.hooks = hooks  # fault injection: during_save(step, files_written), after_commit(step, path)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if async_save else None
        self._snapshot = HostSnapshot()
        self._pending: Optional[Future] = None
        self.last_saved_step: Optional[int] = None
        if comm.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            self._check_writable()
            self._remove_leftovers()

    # ---- saving -------------------------------------------------------------------------
    def save(self, step: int, objects: Dict[str, Stateful], per_rank: Dict[str, Stateful], meta: Dict[str, Any]) -> None:
        """Collective: every rank calls it at the same step."""
        gathered = self.comm.gather_object({name: obj.state_dict() for name, obj in per_rank.items()})
        self.last_saved_step = step
        if self.comm.rank != 0:
            return
        self.wait()
        started = time.perf_counter()
        states = {name: obj.state_dict() for name, obj in objects.items()}
        states["ranks"] = {"ranks": gathered}
        if self._pool is None:
            self._write_and_commit(step, states, meta, started)
        else:
            states = self._snapshot.copy(states)
            self.on_event(Event.CHECKPOINT_SNAPSHOT, step=step, blocked_seconds=round(time.perf_counter() - started, 4))
            self._pending = self._pool.submit(self._write_and_commit, step, states, meta, started)

    def wait(self) -> None:
        """Finish a save still being written in the background; its failure stops the run here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _write_and_commit(self, step: int, states: Dict[str, Any], meta: Dict[str, Any], started: float) -> Path:
        final = self.folder / mf.step_dir_name(step)
        tmp = self.folder / f"{mf.TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            files = {}
            for name, tree in states.items():
                size, digest = tensorfile.save(tree, tmp / f"{name}.bin")
                files[f"{name}.bin"] = {"bytes": size, "checksum": digest}
                if self.hooks is not None:
                    self.hooks.during_save(step, len(files))
            manifest = {
                "format": mf.FORMAT, "step": step, **meta, "world_size": self.comm.world_size,
                "created": time.time(), "files": files, "config": self.training_config, "full_config": self.full_config,
            }
            with open(tmp / mf.MANIFEST, "w") as f:
                f.write(_json(manifest))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # a leftover of this step (an earlier crash, or a re-save): replace it
                final.rename(self.folder / f"{mf.TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
            os.rename(tmp, final)
            _fsync_dir(self.folder)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            previous = mf.committed(self.folder)
            kept = f"the newest committed checkpoint ({previous[0][1].name}) is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointError(f"saving checkpoint step {step} to {self.folder} failed: {type(exc).__name__}: {exc}; {kept}") from exc
        total = sum(f["bytes"] for f in files.values())
        seconds = time.perf_counter() - started
        self.on_event(Event.CHECKPOINT_SAVED, step=step, epoch=meta.get("epoch"), path=str(final), bytes=total, seconds=round(seconds, 4))
        log.info("Checkpoint step %d committed (%.1f MB in %.2f s): %s", step, total / 1e6, seconds, final)
        self._apply_retention()
        if self.hooks is not None:
            self.hooks.after_commit(step, final)
        return final

    def _apply_retention(self) -> None:
        ckpts = mf.committed(self.folder)
        for i, (step, path) in enumerate(ckpts):
            if i < self.keep_last:
                continue  # the newest keep_last (>= 1) are always kept
            if self.keep_every_n_epochs:
                try:
                    epoch = mf.read(path).get("epoch", 0)
                    if epoch and epoch % self.keep_every_n_epochs == 0 and not mf.read(path).get("batch_in_epoch"):
                        continue
                except ValueError:
                    pass
            self._discard(path)
        self._remove_leftovers(only_trash=True)

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
    def restore(self, objects: Dict[str, Stateful], per_rank: Dict[str, Stateful], allow_config_change: bool,
                fresh_start_if_unusable: bool = False,
                new_rank: Optional[Callable[[int], None]] = None) -> Optional[Restored]:
        """Collective: load the newest checkpoint that verifies into `objects`; None if there is none.

        A checkpoint saved by another number of workers is refused unless `new_rank` is given (an
        elastic job): then ranks the checkpoint has keep their saved per-rank state, and a rank it
        does not have calls `new_rank(step)` to seed its state deterministically."""
        decision: Dict[str, Any] = {}
        states: Optional[Dict[str, Any]] = None
        if self.comm.rank == 0:
            decision, states = self._choose(allow_config_change)
        decision = self.comm.broadcast_object(decision)
        if decision.get("error"):
            raise CheckpointError(decision["error"])
        if decision.get("unusable"):
            detail = "; ".join(decision["unusable"])
            if not fresh_start_if_unusable:
                raise CheckpointError(
                    f"none of the {len(decision['unusable'])} committed checkpoints in {self.folder} is usable ({detail}). "
                    "They are kept as they are. Set run.fresh_start_if_unusable=true to train from scratch anyway")
            log.warning("No usable checkpoint (%s); starting from scratch as run.fresh_start_if_unusable allows", detail)
            return None
        if not decision.get("path"):
            return None
        path = Path(decision["path"])
        manifest = decision["manifest"]
        if states is None:  # other ranks: rank 0 verified the checksums; check sizes while reading
            states = {name[:-4]: tensorfile.load(path / name, spec["bytes"]) for name, spec in manifest["files"].items()}
        ranks = states["ranks"]["ranks"]
        if len(ranks) != self.comm.world_size and new_rank is None:
            raise CheckpointError(f"{path}: saved by {len(ranks)} workers, this run has {self.comm.world_size} "
                                  "(trainer.on_world_size_change=refuse)")
        for name, obj in objects.items():
            if name not in states:
                raise CheckpointError(f"{path}: no {name}.bin in this checkpoint")
            try:
                obj.load_state_dict(states[name])
            except Exception as exc:
                raise CheckpointError(f"{path / (name + '.bin')}: cannot restore {name}: {exc}") from exc
        for name, obj in per_rank.items():
            if self.comm.rank >= len(ranks):
                assert new_rank is not None
                new_rank(manifest["step"])
                break
            try:
                obj.load_state_dict(ranks[self.comm.rank][name])
            except Exception as exc:
                raise CheckpointError(f"{path / 'ranks.bin'}: cannot restore {name} of rank {self.comm.rank}: {exc}") from exc
        self.last_saved_step = manifest["step"]
        return Restored(step=manifest["step"], path=path, manifest=manifest)

    def _choose(self, allow_config_change: bool) -> tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        candidates = mf.committed(self.folder)
        problems: List[str] = []
        for step, path in candidates:
            try:
                manifest = mf.read(path)
                states = {
                    name[:-4]: tensorfile.load(path / name, spec["bytes"], spec["checksum"])
                    for name, spec in manifest["files"].items()
                }
            except (OSError, ValueError, KeyError) as exc:
                problems.append(f"{path.name}: {exc}")
                log.warning("Checkpoint %s is unusable, trying an older one: %s", path, exc)
                self.on_event(Event.CHECKPOINT_INVALID, step=step, path=str(path), error=str(exc))
                continue
            diff = mf.changes(manifest.get("config", {}), self.training_config)
            if diff and not allow_config_change:
                return {"error": (
                    f"checkpoint {path} was made with a different training config; refusing to resume. Changed: "
                    f"{mf.describe_changes(diff)}. Restore those values, choose another run.name, or set "
                    "run.allow_config_change=true to resume anyway")}, None
            if diff:
                self.on_event(Event.CONFIG_CHANGED_ON_RESUME, step=step, accepted="run.allow_config_change", changes=[list(d) for d in diff])
            safe = [d for d in mf.changes(manifest.get("full_config", {}), self.full_config) if d not in diff]
            if safe:
                self.on_event(Event.CONFIG_CHANGED_ON_RESUME, step=step, accepted="safe to change", changes=[list(d) for d in safe])
            return {"path": str(path), "manifest": manifest, "skipped": problems}, states
        if problems:
            return {"unusable": problems}, None
        return {}, None


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=1, default=str) + "\n"
