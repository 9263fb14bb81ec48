"""One rank's part of a save in which every rank writes its own files (the sharded format): what it
wrote, read back and reports to rank 0, which commits (CheckpointManager._commit_written)."""

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
    """A save under way: its step, codec and fields; the name the store staged it under (None: rank 0
    could not stage it); a problem that fails it; this rank's report once written (its future, async)."""

    step: int
    codec: Codec
    meta: Dict[str, Any]
    started: float
    tmp: Optional[str]
    problem: Optional[str]
    report: Dict[str, Any] = field(default_factory=dict)
    unavailable: bool = False  # rank 0: its store could not stage it (unreachable)
    future: Optional["Future[Dict[str, Any]]"] = None


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
    store: Store,
    save: RankWrite,
    pieces: Dict[str, List[Any]],
    planned: Optional[Planned],
    rank: int,
    hooks: Optional[SaveHooks],
) -> Dict[str, Any]:
    """Write this rank's files (name -> its buffers, in order) into the staged save, each durable and read
    back; the report rank 0 commits from: {"files": {name: {bytes, checksum}}, ...the codec's} or
    {"error": ...}. Never raises (a failure is reported, and fails the save on every rank)."""
    try:
        if save.problem is not None or save.tmp is None:
            raise RuntimeError(save.problem or "rank 0 could not stage the save")
        written = write_files(store, save.tmp, save.step, pieces, hooks)  # each read back before it is reported
        return {"files": written, **(planned.report if planned is not None else {})}
    except Exception as exc:
        return {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "unavailable": isinstance(exc, StoreError)}
