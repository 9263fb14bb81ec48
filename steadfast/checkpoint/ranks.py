"""One rank's part of a save: what it writes (its files, as the codec planned them), read back where it
is not the only writer, and reports to rank 0, which commits (CheckpointManager._commit_written)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

from .codec import Codec, Planned
from .storage import Store
from .storage.base import Batch, StoreError


class SaveHooks(Protocol):
    """What the writer calls while it saves (fault injection, the heartbeat, the orphan fence)."""

    def during_save(self, step: int, files_written: int) -> None: ...

    def before_commit(self, step: int) -> None: ...

    def after_commit(self, step: int, path: str) -> None: ...


@dataclass
class RankWrite:
    """A save under way on one rank: its step, codec, fields and plan; whether rank 0 writes it alone
    (`alone`: the codec planned files for rank 0 only, the replicated format; else every rank writes its
    own, the sharded one); the name the store staged it under (None: not staged, or rank 0 could not);
    a problem that fails it; this rank's report once written (its future: an asynchronous save of every
    rank, committed at a step boundary)."""

    step: int
    codec: Codec
    meta: Dict[str, Any]
    started: float
    planned: Optional[Planned]
    alone: bool
    tmp: Optional[str] = None
    problem: Optional[str] = None
    report: Dict[str, Any] = field(default_factory=dict)
    unavailable: bool = False  # rank 0: its store could not stage it (unreachable)
    failure: Optional[BaseException] = None  # rank 0 writing alone: what failed it, raised as the cause
    batch: Optional[Batch] = None  # rank 0 writing alone: its files made durable with the manifest, together
    future: Optional["Future[Optional[str]]"] = None


def write_files(
    store: Store, staged: str, step: int, pieces: Dict[str, List[Any]], hooks: Optional[SaveHooks], batch: Optional[Batch] = None
) -> Dict[str, Dict[str, Any]]:
    """The one file loop of every save: this rank's files (name -> its buffers, in order) written into
    the staged save; {name: {bytes, checksum}}. With `batch` (rank 0 writing every file: the replicated
    format) they become durable with the manifest, together; without (every rank writing its own), each
    is durable and read back before this returns. Raises on any failure."""
    written: Dict[str, Dict[str, Any]] = {}
    for file, buffers in pieces.items():
        size, digest = store.write(staged, file, buffers, batch, verify=batch is None)
        written[file] = {"bytes": size, "checksum": digest}
        if hooks is not None:
            hooks.during_save(step, len(written))
    return written


def write_own(
    store: Store, save: RankWrite, pieces: Dict[str, List[Any]], rank: int, hooks: Optional[SaveHooks]
) -> Dict[str, Any]:
    """Write this rank's files (name -> its buffers, in order) into the staged save; the report rank 0
    commits from: {"files": {name: {bytes, checksum}}, ...the codec's} or {"error": ...}. Never raises
    an Exception (a failure is reported, and fails the save on every rank); rank 0 writing alone keeps
    any failure, even an interrupt, in `save.failure` (the commit raises it, after abandoning the save)."""
    try:
        if save.problem is not None or save.tmp is None:
            raise RuntimeError(save.problem or "rank 0 could not stage the save")
        written = write_files(store, save.tmp, save.step, pieces, hooks, save.batch)
        return {"files": written, **(save.planned.report if save.planned is not None else {})}
    except BaseException as exc:
        if not (save.alone or isinstance(exc, Exception)):
            raise
        save.failure = save.failure or exc
        return {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "unavailable": isinstance(exc, StoreError)}
