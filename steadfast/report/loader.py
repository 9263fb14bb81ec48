"""Reading a run folder for the report: every file through the contract's bounded, validated readers.

events.jsonl through `steadfast.contract.events.read` (the one event reader), summary.json through
`steadfast.contract.summary.read`, metrics.jsonl through `steadfast.contract.files.read_jsonl`, and
config.yaml (the run's frozen config: where its checkpoints are) with `yaml.safe_load`. Nothing is
evaluated or unpickled; a file that is missing or damaged becomes a line in `RunRecords.problems`,
never an exception.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, List, Optional

import yaml

from ..checkpoint.storage.base import location, scheme_of
from ..contract import events, summary
from ..contract.files import (
    CONFIG_FILE,
    EVENTS_FILE,
    MAX_JSON_BYTES,
    MAX_JSONL_BYTES,
    METRICS_FILE,
    SUMMARY_FILE,
    read_jsonl,
    read_regular,
)
from . import checkpoints
from .records import RunRecords, metric_rows, summary_from

MARKERS = (EVENTS_FILE, SUMMARY_FILE)  # a folder holding one of these is a run folder (the launcher writes both)


def _state(path: Path, max_bytes: int) -> Optional[str]:
    """None when `path` is a regular file the readers accept; else what is wrong with it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size > max_bytes:
        return f"larger than {max_bytes >> 20} MB, not read"
    return None


def _lines(path: Path, max_bytes: int) -> int:
    data = read_regular(path, max_bytes)
    return 0 if data is None else sum(1 for line in data.splitlines() if line.strip())


def _events(folder: Path, problems: List[str]) -> List[Any]:
    path = folder / EVENTS_FILE
    state = _state(path, MAX_JSONL_BYTES)
    if state is not None:
        problems.append(f"{EVENTS_FILE}: {state}: no launches or attempts to show")
        return []
    lines = _lines(path, MAX_JSONL_BYTES)  # counted first: a running job only appends, so never over-counted
    records = events.read(folder)
    skipped = lines - len(records)
    if not records:
        problems.append(f"{EVENTS_FILE}: no usable event in it: no launches or attempts to show")
    elif skipped > 0:
        problems.append(
            f"{EVENTS_FILE}: {skipped} line(s) that are not an event of this version skipped "
            "(cut by a crash, damaged, or written by a newer version)"
        )
    return records


def _metrics(folder: Path, records: RunRecords) -> None:
    path = folder / METRICS_FILE
    state = _state(path, MAX_JSONL_BYTES)
    if state is not None:
        records.problems.append(f"{METRICS_FILE}: {state}: no loss curve, no time per step")
        return
    lines = _lines(path, MAX_JSONL_BYTES)
    raw = read_jsonl(path)
    records.metrics, unusable = metric_rows(raw)
    damaged = lines - len(raw)
    if damaged > 0:
        records.problems.append(
            f"{METRICS_FILE}: {damaged} line(s) that are not a JSON object skipped (cut by a crash, or damaged)"
        )
    if unusable:
        records.problems.append(f"{METRICS_FILE}: {unusable} row(s) without a numeric time and step skipped")


def _summary(folder: Path, records: RunRecords) -> None:
    state = _state(folder / SUMMARY_FILE, MAX_JSON_BYTES)
    if state is not None:
        records.problems.append(
            f"{SUMMARY_FILE}: {state}"
            + (": the launch is still running, or its launcher was killed" if state == "missing" else "")
        )
        return
    raw = summary.read(folder)
    if not raw:
        records.problems.append(f"{SUMMARY_FILE}: empty, or not a JSON object (damaged): no status, steps or losses from it")
        return
    records.summary, bad = summary_from(raw)
    if bad:
        records.problems.append(f"{SUMMARY_FILE}: unusable value(s) of {', '.join(bad)}, not shown")


def checkpoint_dir(folder: Path, config_text: Optional[str]) -> tuple[str, Optional[str]]:
    """Where the run's checkpoints are, from its frozen config (`checkpoint.dir`: a folder or a store's
    location; default <run folder>/checkpoints), and what was wrong with the config when the default
    had to be taken.

    A relative checkpoint.dir is relative to the working directory, as it was for the workers."""
    default = location(None, folder)
    if config_text is None:
        return default, "no config"
    try:
        config = yaml.safe_load(config_text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        return default, f"not valid YAML ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    if not isinstance(config, dict):
        return default, "not a mapping of config groups"
    section = config.get("checkpoint") or {}
    if not isinstance(section, dict):
        return default, f"checkpoint is {section!r:.80}, not a config group"
    value = section.get("dir")
    if value is not None and not isinstance(value, str):
        return default, f"checkpoint.dir is {value!r:.80}, not a folder"
    return location(value, folder), None


def _checkpoints(folder: Path, records: RunRecords) -> None:
    path = folder / CONFIG_FILE
    state = _state(path, MAX_JSON_BYTES)
    data = read_regular(path, MAX_JSON_BYTES) if state is None else None
    try:
        config_text = data.decode() if data is not None else None
    except UnicodeDecodeError:
        config_text, state = None, "not UTF-8 text"
    records.checkpoint_dir, problem = checkpoint_dir(folder, config_text)
    if problem is not None:
        records.problems.append(
            f"{CONFIG_FILE}: {state or problem}: verified the default checkpoint folder {records.checkpoint_dir}"
        )
    where = records.checkpoint_dir
    custom = where != location(None, folder)
    if custom and not scheme_of(where) and not Path(where).is_absolute() and not Path(where).is_dir():
        records.problems.append(
            f"checkpoint folder {records.checkpoint_dir}: not found from here (a relative checkpoint.dir "
            "is relative to the folder the run was launched from: run the report there)"
        )
    try:
        records.checkpoints = checkpoints.verify(records.checkpoint_dir)
    except OSError as exc:
        records.problems.append(f"checkpoint folder {records.checkpoint_dir}: cannot be listed ({exc.strerror or exc})")


def load_run(folder: Path) -> RunRecords:
    """Everything the report needs from one run folder, validated."""
    folder = Path(folder)
    records = RunRecords(folder=folder)
    records.events = _events(folder, records.problems)
    _metrics(folder, records)
    _summary(folder, records)
    _checkpoints(folder, records)
    return records


def is_run(folder: Path) -> bool:
    """A run folder: it holds the launcher's records (events.jsonl or summary.json), even damaged ones."""
    return any(os.path.lexists(folder / name) for name in MARKERS)


def find_runs(folder: Path) -> List[Path]:
    """The run folders under a sweep folder (any depth up to 3, hidden folders left out), in name order."""
    found = set()
    for name in MARKERS:
        for pattern in (f"*/{name}", f"*/*/{name}", f"*/*/*/{name}"):
            for p in folder.glob(pattern):
                rel = p.parent.relative_to(folder).parts
                if not any(part.startswith(".") for part in rel):
                    found.add(p.parent)
    return sorted(found)
