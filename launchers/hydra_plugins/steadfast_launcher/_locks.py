"""The launcher's locks: one launch per run folder (and per folder of hydra.launcher.lock_dirs, e.g.
a shared checkpoint.dir), one launcher per sweep folder.

flock is released by the kernel when the holder dies, so a crashed launch never leaves a lock that
blocks the next one; the lock file only tells a refused launch who holds it. A filesystem that
cannot flock (NFS mounted with local_lock but without a lock manager, Lustre without `flock`)
is refused with a message that names it and the fix, never silently run unlocked.

Lock files are opened without following a symlink and must be regular files (a symlinked
`.steadfast.lock` would have had its target truncated). A launch refused by any of its locks takes
back what it created for them: the lock files, then the folders (a new checkpoint.dir), never
anything that was there before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from steadfast.contract.files import LOCK_FILE

from ._types import Refused

log = logging.getLogger(__name__)

GATE_FILE = LOCK_FILE + ".gate"
SWEEP_LOCK_FILE = ".steadfast_sweep.lock"
MOUNTINFO = "/proc/self/mountinfo"


def filesystem(path: Path) -> Tuple[str, str, str]:
    """(type, mount point, options) of the filesystem holding `path`, from the kernel's mount table."""
    target = os.path.realpath(path)
    best: Tuple[str, str, str] = ("unknown", "?", "")
    try:
        with open(MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    longest = -1
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or not tail:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > longest:
            longest = len(mount)
            best = (tail[0], mount, ",".join(o for o in (fields[5], tail[2] if len(tail) > 2 else "") if o))
    return best


def lock_unsupported(folder: Path, exc: OSError) -> Refused:
    fstype, mount, options = filesystem(folder)
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if fstype.startswith("nfs"):
        fix = "mount it with -o local_lock=none and a working lock manager (or local_lock=flock for one host)"
    elif fstype == "lustre":
        fix = "mount Lustre with -o flock"
    else:
        fix = "mount it with flock support (NFS: local_lock=none; Lustre: flock)"
    return Refused(
        f"Cannot lock {folder}: flock failed with {code} ({exc.strerror}) on its {fstype} filesystem "
        f"(mounted at {mount}{', options ' + options if options else ''}). Fix: {fix}, or put the run folder "
        "on a local or flock-capable filesystem (hydra.sweep.dir=/local/path)."
    )


def _flock(fd: int, how: int, folder: Path) -> bool:
    """True if taken; False if another process holds it; Refused if the filesystem cannot lock."""
    try:
        fcntl.flock(fd, how)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        raise lock_unsupported(folder, exc) from None


def _holder(fd: int) -> str:
    return os.pread(fd, 1024, 0).decode(errors="replace").strip()


def _try_flock(fd: int, how: int) -> bool:
    """False only if another process holds it; a filesystem that cannot lock counts as taken (nobody can hold it)."""
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_lock_file(path: Path) -> Tuple[int, bool]:
    """(descriptor, whether this call created the file) of a regular lock file at `path`, never
    through a symlink; Refused for anything else there (a symlink, a FIFO, a folder)."""
    try:
        try:
            fd, created = os.open(path, LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd, created = os.open(path, LOCK_FLAGS), False
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise Refused(
                f"{path} is not a regular file (a symbolic link, folder or device); remove it and launch again"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{path} is not a regular file; remove it and launch again")
    return fd, created


def _missing_folders(folder: Path) -> List[Path]:
    """The folders on the way to `folder` that do not exist yet, innermost first."""
    out, path = [], Path(os.path.abspath(folder))
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out


class FolderLock:
    """One folder for one launch, or for the launchers of one multi-node job.

    A multi-node job runs one launcher per node on the same (shared) folder: its launchers hold
    the lock *shared*, and the first one records the job's identity (backend, rendezvous id and
    endpoint) in the lock file. A later launcher joins only if its identity is the same; a
    single-node launch (exclusive) or another multi-node job is refused. A short exclusive lock on
    a second file makes check-and-record one step.
    """

    def __init__(self, folder: Path, what: str, hint: str, multi_node: Optional[str] = None, note: str = "") -> None:
        self.folder, self.what, self.hint, self.multi_node, self.note = folder, what, hint, multi_node, note
        self.fd = -1
        self.shared = False
        self.created: List[Path] = []  # what this lock made (folders innermost first, then files): undo() removes it

    def acquire(self) -> "FolderLock":
        me = f"pid {os.getpid()} on {socket.gethostname()}{self.note}"
        missing = _missing_folders(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.created = [f for f in missing if f.is_dir()]
        gate = -1
        try:
            gate = self._open(GATE_FILE)
            _flock(gate, fcntl.LOCK_EX, self.folder)  # held for a moment: the check and the record are one step
            self.fd = self._open(LOCK_FILE)
            if _flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.folder):
                os.ftruncate(self.fd, 0)
                if self.multi_node is not None:
                    os.write(self.fd, f"multi-node job {self.multi_node}: first launcher {me}\n".encode())
                    fcntl.flock(self.fd, fcntl.LOCK_SH)  # let the job's other launchers in
                    self.shared = True
                else:
                    os.write(self.fd, f"{me}\n".encode())
                return self
            owner = _holder(self.fd) or "another process"
            if (
                self.multi_node is not None
                and owner.startswith(f"multi-node job {self.multi_node}:")
                and _flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB, self.folder)
            ):
                self.shared = True
                log.info("%s %s: joining multi-node job %s (%s)", self.what, self.folder, self.multi_node, owner)
                return self
            os.close(self.fd)
            self.fd = -1
            mine = f" (this launch is multi-node job {self.multi_node})" if self.multi_node else ""
            raise Refused(
                f"{self.what} {self.folder} is in use by {owner}{mine}. Wait for that launch to end, or "
                f"{self.hint}. (The launchers of one multi-node job share a folder when they agree on "
                "backend.rdzv_backend, backend.rdzv_endpoint and the rendezvous id, backend.rdzv_id or run.name.)"
            )
        except BaseException:
            if gate >= 0:
                os.close(gate)
                gate = -1
            self.undo()
            raise
        finally:
            if gate >= 0:
                os.close(gate)

    def _open(self, name: str) -> int:
        fd, created = open_lock_file(self.folder / name)
        if created:
            self.created.insert(0, self.folder / name)
        return fd

    def undo(self) -> None:
        """Release, and remove what this lock created: for a launch refused before its job ran.
        The lock file goes only while no other launcher holds it (taken exclusively under the
        gate, which every launcher holds from opening the lock file until it has locked it)."""
        files = [p for p in self.created if p.parent == self.folder]
        folders = [p for p in self.created if p not in files]
        self.created = []
        gate = -1
        try:
            if files:
                gate, _ = open_lock_file(self.folder / GATE_FILE)
                _try_flock(gate, fcntl.LOCK_EX)
            if self.folder / LOCK_FILE in files:
                if self.fd < 0 or not _try_flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    return  # another launcher holds it (one of the same multi-node job joined): theirs now
                os.unlink(self.folder / LOCK_FILE)
            if self.folder / GATE_FILE in files:
                os.unlink(self.folder / GATE_FILE)
            for folder in folders:
                folder.rmdir()  # only when empty
        except (OSError, Refused):
            return  # left in place: someone else uses it now
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if gate >= 0:
                os.close(gate)

    def release(self) -> None:
        if self.fd < 0:
            return
        if not self.shared:
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing releases the flock
        self.fd = -1


class RunLock:
    """A job's folders for the duration of its launch: every folder of hydra.launcher.lock_dirs,
    then the run folder. Taken before Hydra writes anything into the run folder (.hydra/, the log),
    so a refused launch never touches a running job's files; lock_dirs come first, so a launch
    refused for a shared checkpoint.dir creates nothing in its own run folder either."""

    def __init__(self, run_dir: Path, lock_dirs: List[Path], multi_node: Optional[str] = None) -> None:
        self.locks = [
            FolderLock(
                d,
                "Folder",
                "give each run its own (hydra.launcher.lock_dirs lists it: checkpoint.dir)",
                multi_node,
                note=f" (run folder {run_dir})",
            )
            for d in dict.fromkeys(lock_dirs)
            if d != run_dir
        ]
        self.locks.append(FolderLock(run_dir, "Run folder", "choose another run.name", multi_node))
        self._stack = ExitStack()

    def acquire(self) -> "RunLock":
        """Every lock, or none and nothing they created (Refused names the folder in use and its holder)."""
        taken: List[FolderLock] = []
        try:
            for lock in self.locks:
                taken.append(lock.acquire())
        except BaseException:
            for lock in reversed(taken):
                lock.undo()
            raise
        with ExitStack() as stack:
            for lock in taken:
                stack.callback(lock.release)
            self._stack = stack.pop_all()
        return self

    def release(self) -> None:
        self._stack.close()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_sweep_locks: Dict[str, int] = {}


def lock_sweep(sweep_dir: Path) -> Optional[str]:
    """One launcher per sweep folder, held until this process ends (a sweeper may call the launcher
    once per batch). Returns who holds it, if not this process."""
    key = str(sweep_dir.resolve())
    if key in _sweep_locks:
        return None
    fd, _ = open_lock_file(sweep_dir / SWEEP_LOCK_FILE)
    try:
        taken = _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, sweep_dir)
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        owner = _holder(fd) or "another launcher"
        os.close(fd)
        return owner
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _sweep_locks[key] = fd
    return None


def unlock_sweep(sweep_dir: Path, remove: bool = False) -> None:
    """Release this process's sweep lock (a launch refused before any job ran); `remove`: also
    delete the lock file, for a sweep folder this launch created and leaves empty."""
    fd = _sweep_locks.pop(str(sweep_dir.resolve()), None)
    if fd is None:
        return
    if remove:  # unlinked while held, so no other launcher can be holding this file
        (sweep_dir / SWEEP_LOCK_FILE).unlink(missing_ok=True)
    os.close(fd)
