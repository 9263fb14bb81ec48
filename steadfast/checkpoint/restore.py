"""Which checkpoint a resume uses, and the checks that make any bad checkpoint "unusable, fall back".

Rank 0 lists the committed checkpoints newest first by commit sequence and takes the first whose
manifest validates, whose files all match their sizes and checksums and parse as tensor files, and
whose contents hold what this run restores. Every failure on the way is an unusable checkpoint,
never an exception that escapes: it is named in the log and in events.jsonl (checkpoint_invalid),
and once a usable one is found (or a fresh start is allowed), the unusable ones tried are moved
aside, not deleted. Resource errors (out of memory, an I/O error) skip a checkpoint without moving it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..contract.events import Event
from . import fileio, tensorfile
from . import manifest as mf

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored; the message names the file and the cause."""


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str) + "\n"


def from_json(text: str) -> Any:
    return json.loads(text)


def load_checked(path: Path, manifest: Dict[str, Any], objects: List[str], per_rank: List[str]) -> Dict[str, Any]:
    """Every file of the checkpoint at `path`, verified against `manifest` and parsed, after checking
    it holds `objects` and, per saved rank, `per_rank`. Raises ValueError (FileCheckError: the
    checkpoint is bad), OSError or MemoryError (it could not be read now)."""
    missing = [n for n in [*objects, "ranks"] if f"{n}.bin" not in manifest["files"]]
    if missing:
        raise fileio.FileCheckError(f"{path}: no {', '.join(n + '.bin' for n in missing)} in its manifest", "missing")
    dir_fd = fileio.open_folder(path)
    try:
        states = {
            name[:-4]: tensorfile.load(path / name, spec["bytes"], spec["checksum"], dir_fd)
            for name, spec in manifest["files"].items()
        }
    finally:
        os.close(dir_fd)
    ranks = states["ranks"].get("ranks") if isinstance(states["ranks"], dict) else None
    if (
        not isinstance(ranks, list)
        or len(ranks) != manifest["world_size"]
        or not all(isinstance(r, dict) and all(n in r for n in per_rank) for r in ranks)
    ):
        raise fileio.FileCheckError(
            f"{path / 'ranks.bin'}: does not hold {per_rank} for each of the {manifest['world_size']} ranks the manifest names",
            "contents",
        )
    return states


def verify(path: Path) -> Optional[str]:
    """None when the committed checkpoint at `path` verifies (manifest, sizes, checksums); else why not."""
    try:
        files = mf.read(path)["files"]
        dir_fd = fileio.open_folder(path)
        try:
            for name, spec in files.items():
                fileio.verify_file(path / name, spec["bytes"], spec["checksum"], dir_fd)
        finally:
            os.close(dir_fd)
    except (ValueError, OSError, MemoryError) as exc:
        return str(exc) or type(exc).__name__
    return None


class Chooser:
    """Rank 0's choice of the checkpoint to resume from (see the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        training_config: Dict[str, Any],
        full_config: Dict[str, Any],
        on_event: Callable[..., None],
        set_aside: Callable[[Optional[int], Path, str, str], Any],
    ) -> None:
        self.folder, self.training_config, self.full_config = folder, training_config, full_config
        self.on_event, self.set_aside = on_event, set_aside

    def _unusable(self, c: mf.Listed, error: str) -> str:
        log.warning("Checkpoint %s is unusable, trying an older one: %s", c.path, error)
        self.on_event(Event.CHECKPOINT_INVALID, step=c.step, path=str(c.path), error=error)
        return f"{c.path.name}: {error}"

    def choose(
        self, objects: List[str], per_rank: List[str], allow_config_change: bool, fresh_start_if_unusable: bool
    ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        problems: List[str] = []
        movable: List[Tuple[mf.Listed, str, str]] = []  # (checkpoint, reason, error): bad for good, not just now
        chosen: Optional[Tuple[mf.Listed, Dict[str, Any]]] = None
        for c in mf.scan(self.folder):
            if c.manifest is None:
                problems.append(self._unusable(c, c.error or "unreadable manifest"))
                movable.append((c, "manifest", c.error or ""))
                continue
            if chosen is not None:
                continue  # older than the one chosen: left alone (only unreadable manifests are looked for)
            try:
                states = load_checked(c.path, c.manifest, objects, per_rank)
            except ValueError as exc:  # FileCheckError, TensorFileError, ManifestError
                problems.append(self._unusable(c, str(exc)))
                movable.append((c, getattr(exc, "reason", "damaged"), str(exc)))
                continue
            except (OSError, MemoryError) as exc:
                problems.append(self._unusable(c, f"{type(exc).__name__}: {exc}"))
                continue
            chosen = (c, states)
        if chosen is None:
            if problems and fresh_start_if_unusable:
                for c, reason, error in movable:
                    self.set_aside(c.step, c.path, reason, error)
            return ({"unusable": problems}, None) if problems else ({}, None)
        c, states = chosen
        manifest = c.manifest
        assert manifest is not None
        diff = mf.changes(manifest["config"], self.training_config)
        if diff and not allow_config_change:
            return {
                "error": (
                    f"checkpoint {c.path} was made with a different training config; refusing to resume. Changed: "
                    f"{mf.describe_changes(diff)}. Restore those values, choose another run.name, or set "
                    "run.allow_config_change=true to resume anyway"
                )
            }, None
        for bad, reason, error in movable:
            self.set_aside(bad.step, bad.path, reason, error)
        if diff:
            self.on_event(
                Event.CONFIG_CHANGED_ON_RESUME, step=c.step, accepted="run.allow_config_change", changes=[list(d) for d in diff]
            )
        safe = [d for d in mf.changes(manifest["full_config"], self.full_config) if d not in diff]
        if safe:
            self.on_event(Event.CONFIG_CHANGED_ON_RESUME, step=c.step, accepted="safe to change", changes=[list(d) for d in safe])
        return {"path": str(c.path), "manifest": manifest, "skipped": problems}, states
