"""Whole, checked writes and bounded, validated reads of checkpoint files (no torch: the report uses it).

Writing: every byte is written or the write fails. Linux moves at most 0x7ffff000 bytes per write(2),
and a nearly full disk or a file-size limit (RLIMIT_FSIZE) makes a write short without an error, so
every write loops until its buffer is done, a write that moves nothing is an error, and the file's
size is checked with fstat after fsync. Small pieces (a model's biases and norms) are gathered into
one writev(2) each, without copying them. The xxh3-128 checksum is of the bytes handed to write(2),
which are the bytes in the file once the size check passes (and the read-back after the commit
checks them again): a small file is hashed as it is written (each piece right after its write, while
it is in the cache), a large one while its fsync waits for the disk. The files of one commit are
fsynced side by side with their folder (Unsynced): a journaling filesystem then flushes them in one
journal commit rather than one each.

Reading: regular files only, opened with O_NOFOLLOW | O_NONBLOCK (a symlink is refused, a FIFO never
blocks) relative to the checkpoint folder's own descriptor (opened with O_NOFOLLOW too), checked
with fstat on the open descriptor, size and checksum compared with the manifest's.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import xxhash

from .base import CHECKSUM as CHECKSUM
from .base import Batch
from .base import FileCheckError as FileCheckError
from .base import checksum_of as checksum_of

PathLike = Union[str, Path]  # where a file is: a save joins its paths as strings

WRITE_MAX = 8 << 20  # bytes per write(2) (Linux moves at most 0x7ffff000 per call; 8 MiB calls measured fastest)
GATHER_BELOW = 1 << 20  # pieces smaller than this are written together with writev(2)
GATHER_MAX_BYTES = 1 << 20  # larger gathers were throttled harder by the kernel (measured: 1 MiB best)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
HASH_IN_THREAD_ABOVE = 4 << 20  # below this, a second thread costs more than it saves
FSYNC_THREADS = 4  # fsyncs side by side: a commit's files, its manifest and its folder
READ_CHUNK = 16 << 20
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

# The write primitives, module-level so a test can replace them with ones that write less per call.
_write = os.write
_writev = os.writev


def write_all(fd: int, data: Any) -> None:
    """Write every byte of `data` (any buffer) to `fd`, looping over partial writes."""
    view = memoryview(data).cast("B")
    total, pos = view.nbytes, 0
    while pos < total:
        n = _write(fd, view[pos : pos + WRITE_MAX])
        if n <= 0:
            raise OSError(errno.EIO, f"write moved {n} bytes after {pos} of {total}")
        pos += n


def write_at(fd: int, data: Any, offset: int) -> None:
    """Write every byte of `data` at `offset` (the position of `fd` is left where the last write ended)."""
    os.lseek(fd, offset, os.SEEK_SET)
    write_all(fd, data)


def _write_gathered(fd: int, views: List[memoryview], digest: Any) -> None:
    """One writev(2) for several small pieces; a partial writev continues where it stopped. Each
    piece written is hashed into `digest` (when given)."""
    i = 0
    while i < len(views):
        n = _writev(fd, views[i : i + IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, f"writev moved {n} bytes")
        while i < len(views) and n >= views[i].nbytes:  # pieces written whole
            n -= views[i].nbytes
            if digest is not None:
                digest.update(views[i])
            i += 1
        if n and i < len(views):  # a piece written in part: finish it alone, then gather again
            write_all(fd, views[i][n:])
            if digest is not None:
                digest.update(views[i])
            i += 1


def write_views(fd: int, views: List[memoryview], digest: Any) -> None:
    """Write the buffers in order at `fd`'s position: small ones gathered into one writev(2), large
    ones alone, every byte or OSError; each hashed into `digest` (when given) once written."""
    gathered: List[memoryview] = []
    gathered_bytes = 0
    for v in views:
        if v.nbytes < GATHER_BELOW:
            gathered.append(v)
            gathered_bytes += v.nbytes
            if len(gathered) < IOV_MAX and gathered_bytes < GATHER_MAX_BYTES:
                continue
            _write_gathered(fd, gathered, digest)
            gathered, gathered_bytes = [], 0
        else:
            if gathered:
                _write_gathered(fd, gathered, digest)
                gathered, gathered_bytes = [], 0
            write_all(fd, v)
            if digest is not None:
                digest.update(v)
    if gathered:
        _write_gathered(fd, gathered, digest)


_POOL: List[futures.ThreadPoolExecutor] = []  # emptied in a forked child, which makes its own
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.clear)
START_TIMEOUT_S = 10.0


def _pool() -> futures.ThreadPoolExecutor:
    """Threads for fsyncs that run side by side (fsync releases the GIL), all started with the pool."""
    if not _POOL:
        pool = futures.ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="ckpt-fsync")
        _POOL[:] = [pool]
        # a pool starts a thread for a task that finds none idle: tasks that wait for each other make it
        # start them all now, and they are idle again before this returns (a thread started later, in a
        # save, or still busy with a warm-up task when the save's fsyncs are queued, delays its commit)
        barrier = threading.Barrier(FSYNC_THREADS)
        waiting: List["futures.Future[Any]"] = []
        try:
            for _ in range(FSYNC_THREADS):
                waiting.append(pool.submit(barrier.wait, START_TIMEOUT_S))
        except RuntimeError:  # no thread to be had now (or the interpreter is exiting): started when needed
            barrier.abort()
        futures.wait(waiting, START_TIMEOUT_S)
    return _POOL[0]


def prepare() -> None:
    """Start the fsync threads now (once a process), not in a save."""
    _pool()


def _wait_all(running: Sequence["futures.Future[None]"]) -> None:
    """Wait for every one; then raise the first failure."""
    failures = []
    for f in running:
        try:
            f.result()
        except Exception as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


class Unsynced(Batch):
    """Files written and not yet durable, made durable together by `sync` (one journal commit for
    all of them on the filesystems measured, instead of one per fsync in turn); a large file's fsync
    is already running. `close` releases whatever is left after a failure."""

    def __init__(self) -> None:
        self._files: List[Tuple[int, PathLike, int, Optional["futures.Future[None]"]]] = []

    def add(self, fd: int, path: PathLike, size: int, running: Optional["futures.Future[None]"] = None) -> None:
        """Take `fd` (now this object's to close) of `path`, `size` bytes written; `running`: its fsync."""
        self._files.append((fd, path, size, running))

    def sync(self, folder: Optional[PathLike] = None) -> None:
        """fsync every file (and `folder`, when given) side by side, check each file's size, close them."""
        dir_fd = None
        started = [r for *_, r in self._files if r is not None]
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY) if folder is not None else None
            idle = [fd for fd, _, _, running in self._files if running is None]
            idle += [dir_fd] if dir_fd is not None else []
            if len(idle) > 1:
                pool = _pool()
                started += [pool.submit(os.fsync, fd) for fd in idle[1:]]
            if idle:
                os.fsync(idle[0])
            _wait_all(started)
            for fd, path, size, _ in self._files:
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise OSError(errno.EIO, f"{path}: {actual} bytes on disk after writing {size} (a short write)")
        finally:
            futures.wait(started)  # no descriptor is closed while an fsync uses it
            if dir_fd is not None:
                os.close(dir_fd)
            self.close()

    def close(self) -> None:
        files, self._files = self._files, []
        for fd, _, _, running in files:
            if running is not None:
                futures.wait([running])  # its fsync still uses the descriptor
            os.close(fd)


def write_file(path: PathLike, pieces: Sequence[Any], replace: bool = False, later: Optional[Unsynced] = None) -> Tuple[int, str]:
    """Create `path` (or, with `replace`, truncate an existing regular file; never through a symlink)
    with `pieces` (buffers) in order; returns (bytes, checksum). Without `later` it is fsynced and its
    size checked before this returns; with it, it is left to `later.sync` (with the other files of
    its commit). The pieces' memory must not change until the file is synced. Any failure raises
    OSError; the partial file is left for the caller to remove with its temporary folder."""
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    digest = xxhash.xxh3_128()
    mode = os.O_TRUNC if replace else os.O_EXCL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    running: Optional["futures.Future[None]"] = None
    try:
        large = total > HASH_IN_THREAD_ABOVE
        write_views(fd, views, None if large else digest)
        if large:  # the CPU is idle while the disk flushes: hash then (xxhash and fsync release the GIL)
            running = _pool().submit(os.fsync, fd)
            for v in views:
                digest.update(v)
    except BaseException:
        if running is not None:
            futures.wait([running])
        os.close(fd)
        raise
    own = later if later is not None else Unsynced()
    own.add(fd, path, total, running)
    if later is None:
        own.sync()
    return total, checksum_of(digest)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_folder(path: Path) -> int:
    """A descriptor of the folder `path`, refusing a symlink in its last component."""
    return os.open(path, DIR_FLAGS)


def open_regular(name: str, dir_fd: Optional[int], where: Path) -> Tuple[int, int]:
    """(descriptor, size) of the regular file `name` in the folder `dir_fd`; symlinks, FIFOs,
    devices and folders are refused without blocking."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileCheckError(f"{where}: missing", "missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileCheckError(f"{where}: a symbolic link; checkpoint files must be regular files", "not-regular") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileCheckError(f"{where}: not a regular file", "not-regular")
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def _read_into(fd: int, view: memoryview, where: Path, digest: Any) -> None:
    """Fill `view` from `fd`, hashing each chunk while it is still in the cache."""
    pos, total = 0, view.nbytes
    while pos < total:
        n = os.readv(fd, [view[pos : pos + READ_CHUNK]])
        if n <= 0:
            raise FileCheckError(f"{where}: ended after {pos} of {total} bytes", "size")
        digest.update(view[pos : pos + n])
        pos += n


def _check_checksum(where: Path, digest: Any, checksum: Optional[str]) -> None:
    if checksum is not None and checksum_of(digest) != checksum:
        raise FileCheckError(f"{where}: checksum mismatch (the file was changed or damaged after it was written)", "checksum")


def _check_checksum_name(where: Path, checksum: Optional[str]) -> None:
    if checksum is not None and (not isinstance(checksum, str) or not checksum.startswith(f"{CHECKSUM}:")):
        raise FileCheckError(f"{where}: unknown checksum {str(checksum)[:40]!r} (expected {CHECKSUM}:<hex>)", "checksum")


def read_verified(
    path: Path, size: Optional[int] = None, checksum: Optional[str] = None, dir_fd: Optional[int] = None
) -> bytearray:
    """The bytes of the regular file `path` (relative to `dir_fd` when given), checked against the
    manifest's size and checksum when given. Raises FileCheckError or OSError, nothing else."""
    _check_checksum_name(path, checksum)
    fd, actual = open_regular(path.name if dir_fd is not None else str(path), dir_fd, path)
    try:
        if size is not None and actual != size:
            raise FileCheckError(f"{path}: size is {actual} bytes, the manifest says {size}", "size")
        buf = bytearray(actual)
        digest = xxhash.xxh3_128()
        _read_into(fd, memoryview(buf), path, digest)
    finally:
        os.close(fd)
    _check_checksum(path, digest, checksum)
    return buf


def verify_file(path: Path, size: int, checksum: str, dir_fd: Optional[int] = None) -> None:
    """Read `path` back through a small reused buffer and check its size and checksum (no copy kept)."""
    if checksum is None:
        raise FileCheckError(f"{path}: no checksum to check against", "checksum")
    _check_checksum_name(path, checksum)
    fd, actual = open_regular(path.name if dir_fd is not None else str(path), dir_fd, path)
    try:
        if actual != size:
            raise FileCheckError(f"{path}: size is {actual} bytes, the manifest says {size}", "size")
        digest = xxhash.xxh3_128()
        buf = memoryview(bytearray(min(actual, READ_CHUNK) or 1))
        pos = 0
        while pos < actual:
            n = os.readv(fd, [buf[: min(READ_CHUNK, actual - pos)]])
            if n <= 0:
                raise FileCheckError(f"{path}: ended after {pos} of {actual} bytes", "size")
            digest.update(buf[:n])
            pos += n
    finally:
        os.close(fd)
    _check_checksum(path, digest, checksum)


def read_small(name: str, dir_fd: Optional[int], where: Path, max_bytes: int) -> bytes:
    """A small regular file's bytes (a manifest), refused when larger than `max_bytes`."""
    fd, actual = open_regular(name, dir_fd, where)
    try:
        if actual > max_bytes:
            raise FileCheckError(f"{where}: {actual} bytes, more than the {max_bytes} allowed", "size")
        data = os.read(fd, max_bytes + 1)
        while len(data) < actual:
            more = os.read(fd, max_bytes + 1 - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileCheckError(f"{where}: more than the {max_bytes} bytes allowed", "size")
    return data
