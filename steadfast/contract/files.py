"""The run folder's file names, the atomic write, and bounded, validated reads of what is read back.

Nothing read back from a run folder is ever unpickled or evaluated: JSON only, size-capped,
regular files only, and any failure means "unusable" (None or an empty list), never an exception.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

CONFIG_FILE = "config.yaml"  # the job config, resolved once by the launcher
EVENTS_FILE = "events.jsonl"  # one event a line (see events.py)
SUMMARY_FILE = "summary.json"  # the run's outcome (see summary.py)
METRICS_FILE = "metrics.jsonl"  # one row per logged step or epoch (rank 0)
METRICS_CSV_FILE = "metrics.csv"  # logger.sinks has csv: one row per step, one column per metric (rank 0)
MLFLOW_RUN_FILE = "mlflow_run.json"  # logger.sinks has mlflow: the MLflow run a resume continues
HEARTBEAT_DIR = "heartbeats"  # one small file per rank: its progress counter
STACKS_DIR = "logs/stacks"  # rank<r>.txt: Python stacks dumped when the watchdog finds a rank stuck
LOCK_FILE = ".steadfast.lock"  # the run folder's lock (one launch at a time)

MAX_JSON_BYTES = 16 << 20  # a JSON file we read back (summary, ledger, manifest) larger than this is unusable
MAX_JSONL_BYTES = 256 << 20  # events.jsonl / metrics.jsonl


def atomic_write(path: PathLike, text: str) -> None:
    """Write-to-temp, fsync, rename, fsync the folder: readers see the old or the new file, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: PathLike) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_regular(path: PathLike) -> Optional[Tuple[int, int]]:
    """(descriptor, size) of a regular file, never through a symlink; None for anything else. Opened
    with O_NONBLOCK so a FIFO never blocks, and checked with fstat on the open descriptor so a swap
    after the check cannot fool it. The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st.st_size


def read_regular(path: PathLike, max_bytes: int) -> Optional[bytes]:
    """The bytes of a regular file no larger than `max_bytes`; None for anything else (missing, a
    symlink, a folder, a FIFO or device, too large, unreadable): see _open_regular."""
    opened = _open_regular(path)
    if opened is None:
        return None
    fd, size = opened
    try:
        if size > max_bytes:
            return None
        chunks, left = [], size + 1  # one byte more: a file that grew past the cap is refused
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= max_bytes else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_json_object(path: PathLike, max_bytes: int = MAX_JSON_BYTES) -> Optional[Dict[str, Any]]:
    """A JSON object read back from a file, or None if the file is missing or unusable in any way."""
    data = read_regular(path, max_bytes)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


MAX_LINE_BYTES = 1 << 20  # one record of a JSON-lines file: a longer line is skipped, the rest kept


def read_jsonl(path: PathLike, max_bytes: int = MAX_JSONL_BYTES) -> List[Dict[str, Any]]:
    """The JSON objects of a JSON-lines file, skipping lines that are not one (a line cut by a crash
    or a full disk, one too long). A file past `max_bytes` is read from its last `max_bytes`."""
    opened = _open_regular(path)
    if opened is None:
        return []
    fd, size = opened
    try:
        start = max(0, size - max_bytes)
        data = os.pread(fd, size - start, start)
    except (OSError, MemoryError):
        return []
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if start:
        lines = lines[1:]  # the first one is a part
    out: List[Dict[str, Any]] = []
    for line in lines:
        if not line or len(line) > MAX_LINE_BYTES:
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def append_line(path: Path, line: bytes) -> None:
    """Append one record's line whole: a short write (a full filesystem) is finished or raises, and a
    line cut short before (the file does not end in a newline) is ended first, so records never join."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if _torn(fd):
            line = b"\n" + line
        written = 0
        while written < len(line):
            n = os.write(fd, line[written:])
            if n <= 0:
                raise OSError(f"{path.name}: wrote {written} of {len(line)} bytes")
            written += n
    finally:
        os.close(fd)


MAX_TEXT = 8192  # a string field of a record (a message, a traceback): head and tail kept, the cut marked
MAX_ITEMS = 256  # a list or mapping field


def cap_text(text: str, limit: int = MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    keep = (limit - 64) // 2
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters cut ...] {text[-keep:]}"


def capped(value: Any, depth: int = 0) -> Any:
    """Every string capped, every list and mapping too, so that no record floods the file."""
    if isinstance(value, str):
        return cap_text(value)
    if depth > 8:
        return cap_text(str(value))
    if isinstance(value, dict):
        items = list(value.items())[:MAX_ITEMS]
        return {cap_text(str(k), 256): capped(v, depth + 1) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [capped(v, depth + 1) for v in list(value)[:MAX_ITEMS]]
    return value


def _torn(fd: int) -> bool:
    """The file does not end in a newline (a record before was cut short)."""
    try:
        size = os.fstat(fd).st_size
        return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
    except OSError:
        return False
