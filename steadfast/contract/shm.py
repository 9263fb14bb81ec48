"""The shared-memory segments of a job's snapshots: named by the launcher, removed by the launcher.

A job's segments are files in SHM_DIR named `steadfast-<run folder hash>-<launcher pid>.*`: the
workers create them (steadfast/snapshots.py), the launcher removes them when the job ends, and a
launch of the same run folder removes those of launchers that are gone (killed with SIGKILL).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import List

from .pids import alive

SHM_DIR = Path(os.environ.get("STEADFAST_SHM_DIR") or "/dev/shm")  # the variable: a test's stand-in


def _run_key(run_dir: Path) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def prefix(run_dir: Path, launcher_pid: int) -> str:
    return f"steadfast-{_run_key(run_dir)}-{launcher_pid}"


def remove(segment_prefix: str) -> List[Path]:
    """Remove every segment of one job; returns what was removed."""
    removed: List[Path] = []
    try:
        found = list(SHM_DIR.glob(f"{segment_prefix}.*"))
    except OSError:
        return removed
    for path in found:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_orphans(run_dir: Path) -> List[Path]:
    """Remove the segments of this run folder whose launcher is gone (a launcher killed with SIGKILL)."""
    removed: List[Path] = []
    try:
        found = list(SHM_DIR.glob(f"steadfast-{_run_key(run_dir)}-*.*"))
    except OSError:
        return removed
    for pid in {p.name.split(".", 1)[0].rsplit("-", 1)[1] for p in found}:
        if pid.isdigit() and not alive(int(pid)):
            removed += remove(prefix(run_dir, int(pid)))
    return removed
