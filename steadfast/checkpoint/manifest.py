"""What makes a checkpoint committed, how to list them, and which config changes a resume accepts.

Cheap (no torch): the launcher's pre-flight uses it to refuse a bad resume before workers start.

A checkpoint is a folder `step_<9 digits>` holding its files and `manifest.json` (written last,
then the folder renamed into place from a `.tmp-*` name). Only such folders with a manifest are
committed; anything else in the checkpoint folder is invisible to resume.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ..contract.keys import checked_on_resume

FORMAT = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d{9,})")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def committed(folder: Path) -> List[Tuple[int, Path]]:
    """Committed checkpoints, newest first by step number (never by file time or name order)."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        m = STEP_DIR.fullmatch(child.name)
        if m and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found, reverse=True)


def read(ckpt: Path) -> Dict[str, Any]:
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ckpt / MANIFEST}: unreadable manifest ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{ckpt / MANIFEST}: format {manifest.get('format')!r}, this version reads format {FORMAT}")
    return manifest


def newest_manifest(folder: Path) -> Optional[Dict[str, Any]]:
    for _, path in committed(folder):
        try:
            return read(path)
        except ValueError:
            continue
    return None


def flatten(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def training_config(config: Dict[str, Any], safe_to_change: Iterable[str] = ()) -> Dict[str, Any]:
    """The keys of a resolved job config that must match on resume (flattened, dotted): see contract.keys."""
    safe = list(safe_to_change)
    return {k: v for k, v in flatten(config) if checked_on_resume(k, safe)}


def changes(old: Dict[str, Any], new: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, checkpoint's value, current value) for every key that differs; '<absent>' when missing."""
    absent = "<absent>"
    return [(k, old.get(k, absent), new.get(k, absent)) for k in sorted(set(old) | set(new)) if old.get(k, absent) != new.get(k, absent)]


def describe_changes(diff: List[Tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)
