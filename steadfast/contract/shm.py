"""The shared-memory folder of a launch's snapshots: private to its user, made and removed by the launcher.

Each launch gets a folder in SHM_DIR named `steadfast-<run folder hash>-<nonce>`, the nonce 128
random bits: nobody can guess the name to take it first. The launcher creates it exclusively
(mkdir fails on anything already there), opens it without following a symlink and checks it with
fstat (a folder, owned by this user, mode 0700) before it puts anything in it: the launch's key
(`key`, 32 random bytes, mode 0600). The workers open the folder the same way, check it the same
way, and open every file in it relative to that descriptor: slot files are created with
O_EXCL|O_NOFOLLOW and opened with O_NOFOLLOW|O_NONBLOCK, then checked with fstat (a regular file,
owned by this user, no permission for anyone else) before a byte is read or written. The workers
key the snapshots' digests with the launch's key (steadfast/checkpoint/memory.py), so a snapshot of another
launch, or one written without the key, never verifies.

The key never leaves the folder: not in the environment (Horovod puts its workers' environment on
their command line, which every local user can read), not in the run folder (events.jsonl names
the folder, which is harmless: only its user can enter it).

The launcher holds an flock on the folder for the launch: a later launch of the same run folder
removes this user's folders of that run whose lock nobody holds (their launcher was killed),
recognised by the folder's nonce and that lock, never by a pid, which a new process may have been
given since.

In library mode (a platform starts the workers: docs/platforms.md) there is no launcher of ours to
make the folder, and every restart of the platform's workers on a node must find the same one: its
name comes from the run folder, the launch (rank 0's, agreed over the process group) and the node
(`platform_folder`). The first worker of the node makes it as above under a random name and renames
it into place, so nobody sees it without its key; every worker holds a shared flock on it while it
lives. The last worker of the node to end a launch that ended (completed or stopped) removes it; a
launch the platform gave up on leaves it, and the next launch of the run removes it (remove_orphans).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Callable, Dict, List, Optional

SHM_DIR = Path(os.environ.get("STEADFAST_SHM_DIR") or "/dev/shm")  # the variable: a test's stand-in
PREFIX = "steadfast-"
KEY_FILE = "key"
KEY_BYTES = 32
DIR_MODE, FILE_MODE = 0o700, 0o600
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a symlink fails, a FIFO never blocks
MAX_ATTEMPTS = 5  # new nonces tried when a name is taken (only by someone who guessed 128 random bits)


class NotPrivate(OSError):
    """A folder or file in shared memory that is not this user's private one: never used."""


def run_key(run_dir: Path) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def _check(fd: int, is_kind: Callable[[int], bool], what: Path, exact_mode: Optional[int] = None) -> os.stat_result:
    """fstat of an open descriptor: the kind (stat.S_ISDIR or S_ISREG), this user's, and no
    permission for the group or others (exactly `exact_mode` when given); NotPrivate otherwise."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if not is_kind(st.st_mode):
        raise NotPrivate(errno.EPERM, f"{what} is not a {'folder' if is_kind is stat.S_ISDIR else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise NotPrivate(errno.EPERM, f"{what} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    if (exact_mode is not None and mode != exact_mode) or mode & 0o077:
        raise NotPrivate(errno.EPERM, f"{what} has mode {oct(mode)}: others may use it")
    return st


class LaunchFolder:
    """The launcher's side: the launch's private folder, its key, its lock; removed at the end."""

    def __init__(self, run_dir: Path) -> None:
        self.run_key = run_key(run_dir)
        self.name = f"{PREFIX}{self.run_key}-{secrets.token_hex(16)}"
        self.fd = -1

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    def create(self) -> None:
        """Make the folder and its key (OSError when it cannot be made; the workers then find no
        folder and run without snapshots in memory, saying why)."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                os.mkdir(self.path, DIR_MODE)
                break
            except FileExistsError:
                if attempt == MAX_ATTEMPTS - 1:
                    raise
                self.name = f"{PREFIX}{self.run_key}-{secrets.token_hex(16)}"
        try:
            self.fd = os.open(self.path, DIR_FLAGS)
            os.fchmod(self.fd, DIR_MODE)  # whatever the umask took away
            _check(self.fd, stat.S_ISDIR, self.path, DIR_MODE)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while the launch lives
            key = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, FILE_MODE, dir_fd=self.fd)
            try:
                os.fchmod(key, FILE_MODE)
                if os.write(key, secrets.token_bytes(KEY_BYTES)) != KEY_BYTES:
                    raise OSError(errno.EIO, f"short write of {self.path / KEY_FILE}")
            finally:
                os.close(key)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> List[Path]:
        """Remove the folder and everything in it (the job's snapshots end with it)."""
        if self.fd < 0:
            return []
        try:
            return _remove(self.fd, self.path)
        finally:
            os.close(self.fd)
            self.fd = -1


def _remove(fd: int, path: Path) -> List[Path]:
    """Empty the folder open at `fd` (ours, checked) and remove it; what was removed."""
    try:
        names = os.listdir(fd)
    except OSError:
        return []
    for name in names:
        try:
            os.unlink(name, dir_fd=fd)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        return []
    return [path]


def remove_orphans(run_dir: Path, keep: str = "") -> List[Path]:
    """Remove this user's folders of `run_dir`'s launches whose launcher is gone (nobody holds
    their lock), except those whose name starts with `keep` (this launch's); another user's are never touched."""
    start = f"{PREFIX}{run_key(run_dir)}-"
    try:
        names = [e.name for e in os.scandir(SHM_DIR) if e.name.startswith(start) and not (keep and e.name.startswith(keep))]
    except OSError:
        return []
    removed: List[Path] = []
    for name in names:
        try:
            fd = os.open(SHM_DIR / name, DIR_FLAGS)
        except OSError:
            continue  # not a folder, or not ours to enter
        try:
            _check(fd, stat.S_ISDIR, SHM_DIR / name)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its launcher lives
            removed += _remove(fd, SHM_DIR / name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


_held: Dict[str, int] = {}  # library mode: the folders this process holds a shared flock on, by name


def platform_folder(run_dir: Path, launch_id: str, node: str) -> str:
    """Library mode: the name of this node's folder of the launch `launch_id`, made if it is not there,
    held (shared flock) until `leave_platform_folder`; folders of this run's earlier launches that no
    worker holds are removed. OSError (NotPrivate) when it cannot be made or is not this user's."""
    name = platform_folder_name(run_dir, launch_id, node)
    launch = name[: -len(_digest(node))]
    if name in _held:
        return name
    final = SHM_DIR / name
    if not os.path.lexists(final):
        made = LaunchFolder(run_dir)  # private, with its key, under a random name
        made.create()
        try:
            os.rename(made.path, final)
        except OSError:  # another worker of the node was first (or something else has the name): use what is there
            made.remove()
        else:
            os.close(made.fd)
            made.fd = -1
    fd = os.open(final, DIR_FLAGS)
    try:
        _check(fd, stat.S_ISDIR, final, DIR_MODE)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    _held[name] = fd
    remove_orphans(run_dir, keep=launch)  # this launch's folders of other nodes stay (a rehearsal's nodes share one)
    return name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def platform_folder_name(run_dir: Path, launch_id: str, node: str) -> str:
    return f"{PREFIX}{run_key(run_dir)}-{_digest(launch_id)}-{_digest(node)}"


def leave_platform_folder(name: str, ended: bool) -> List[Path]:
    """Library mode, as a worker ends: let go of the folder; when the launch `ended` (completed or
    stopped, nothing to restore), the last worker of the node to leave removes it."""
    fd = _held.pop(name, -1)
    if fd < 0:
        return []
    try:
        if not ended:
            return []
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while another worker of the node holds it
        return _remove(fd, SHM_DIR / name)
    except OSError:
        return []
    finally:
        os.close(fd)


class Segments:
    """A worker's side: the launch's folder, opened once and checked; every file in it is opened
    relative to that descriptor and checked before use."""

    def __init__(self, name: str) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise NotPrivate(errno.EINVAL, f"{name!r} is not the name of a launch's folder")
        self.path = SHM_DIR / name
        self.fd = os.open(self.path, DIR_FLAGS)
        try:
            _check(self.fd, stat.S_ISDIR, self.path, DIR_MODE)
            self.key = self._key()
        except BaseException:
            os.close(self.fd)
            raise

    def _key(self) -> bytes:
        fd = self.open(KEY_FILE, "read")
        try:
            key = os.pread(fd, KEY_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(key) != KEY_BYTES:
            raise NotPrivate(errno.EINVAL, f"{self.path / KEY_FILE} is not a key of {KEY_BYTES} bytes")
        return key

    def open(self, name: str, how: str) -> int:
        """A checked descriptor of the file `name` in the folder: `read` (O_RDONLY), `write`
        (O_RDWR, an existing file) or `create` (O_RDWR, created exclusively if not there).
        OSError (NotPrivate: there, but not this user's private file) otherwise."""
        if how == "create":
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, FILE_MODE, dir_fd=self.fd)
                os.fchmod(fd, FILE_MODE)
            except FileExistsError:
                fd = os.open(name, os.O_RDWR | FILE_FLAGS, dir_fd=self.fd)
        else:
            fd = os.open(name, (os.O_RDONLY if how == "read" else os.O_RDWR) | FILE_FLAGS, dir_fd=self.fd)
        try:
            _check(fd, stat.S_ISREG, self.path / name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def used_bytes(self) -> int:
        """The size of the files in the folder (what its snapshots hold now)."""
        total = 0
        for name in os.listdir(self.fd):
            try:
                total += os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size
            except OSError:
                pass
        return total

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
