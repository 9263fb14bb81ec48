"""Pickled hand-overs between the launcher and the processes it starts, through private files.

The launcher writes what a process needs (a job's task function, frozen config and Hydra's
state) into a folder only its user can enter (mode 0700, under the system's temporary folder,
never the run folder: nothing in outputs/ is ever unpickled) and passes only a `PayloadRef`:
the path and the sha256 of the bytes. The reader checks the sha256, which came over a channel the
launcher controls (the spawn pipe, horovod.run's arguments, a command line), before it
unpickles anything.

Why a file: multiprocessing's spawn writes a worker's arguments into a pipe while the parent
still holds the pipe's read end, so arguments larger than the pipe buffer (64 KiB) block the
parent until the worker has imported its main module and read them; a worker killed in that
window left torch elastic's agent blocked in that write forever (no restart, no error). A
reference of a few hundred bytes never blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import cloudpickle

from steadfast.contract.files import read_regular
from steadfast.contract.pids import alive


class PayloadError(RuntimeError):
    """A payload file that is missing, changed or not ours: never unpickled."""


@dataclass(frozen=True)
class PayloadRef:
    path: str
    sha256: str
    size: int


def private_folder(prefix: str) -> Path:
    """A new folder only this user can enter (0700), checked after creation. Its name carries this
    process's id, so a later launcher removes it if this one was killed before it could."""
    _remove_orphans(prefix)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        shutil.rmtree(path, ignore_errors=True)
        raise PayloadError(f"temporary folder {path} is not private (mode {oct(stat.S_IMODE(st.st_mode))}, owner {st.st_uid})")
    return path


def _remove_orphans(prefix: str) -> None:
    """This user's folders of `prefix` whose launcher process is gone (killed with SIGKILL)."""
    root = Path(tempfile.gettempdir())
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix) :].partition("-")[0]
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if pid.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A private folder for the duration of a job (or a sweep), removed afterwards."""
    path = private_folder(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write(folder: Path, name: str, value: object) -> PayloadRef:
    data = cloudpickle.dumps(value)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return PayloadRef(str(path), hashlib.sha256(data).hexdigest(), len(data))


def load(ref: PayloadRef) -> Any:
    """The value behind `ref`, unpickled only if the file holds exactly the bytes the launcher wrote."""
    data = read_regular(ref.path, ref.size)
    if data is None or len(data) != ref.size:
        raise PayloadError(f"job payload {ref.path}: missing, or not the file the launcher wrote")
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise PayloadError(f"job payload {ref.path}: its sha256 does not match what the launcher wrote; not unpickled")
    return cloudpickle.loads(data)
