"""Whole, checked writes and bounded, validated reads of checkpoint files (no torch: the report uses it).

Writing: every byte is written or the write fails. Linux moves at most 0x7ffff000 bytes per write(2),
and a nearly full disk or a file-size limit (RLIMIT_FSIZE) makes a write short without an error, so
every write loops until its buffer is done, a write that moves nothing is an error, and the file's
size is checked with fstat after fsync. Small pieces (a model's biases and norms) are gathered into
one writev(2) each, without copying them. The xxh3-128 checksum is computed while fsync waits for the
disk: it is of the bytes handed to write(2), which are the bytes in the file once the size check
passes (and the read-back after the commit checks them again).

Reading: regular files only, opened with O_NOFOLLOW | O_NONBLOCK (a symlink is refused, a FIFO never
blocks) relative to the checkpoint folder's own descriptor (opened with O_NOFOLLOW too), checked
with fstat on the open descriptor, size and checksum compared with the manifest's.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import xxhash

CHECKSUM = "xxh3_128"
WRITE_MAX = 8 << 20  # bytes per write(2) (Linux moves at most 0x7ffff000 per call; 8 MiB calls measured fastest)
GATHER_BELOW = 1 << 20  # pieces smaller than this are written together with writev(2)
GATHER_MAX_BYTES = 1 << 20  # larger gathers were throttled harder by the kernel (measured: 1 MiB best)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
HASH_IN_THREAD_ABOVE = 4 << 20  # below this, a second thread costs more than it saves
READ_CHUNK = 16 << 20
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

# The write primitives, module-level so a test can replace them with ones that write less per call.
_write = os.write
_writev = os.writev


class FileCheckError(ValueError):
    """A file does not match what its manifest says (size, checksum), or is not a regular file.

    `reason` is a short word for the set-aside folder's name: size, checksum, not-regular, missing."""

    def __init__(self, message: str, reason: str = "damaged") -> None:
        super().__init__(message)
        self.reason = reason


def checksum_of(digest: Any) -> str:
    return f"{CHECKSUM}:{digest.hexdigest()}"


def write_all(fd: int, data: Any) -> None:
    """Write every byte of `data` (any buffer) to `fd`, looping over partial writes."""
    view = memoryview(data).cast("B")
    total, pos = view.nbytes, 0
    while pos < total:
        n = _write(fd, view[pos : pos + WRITE_MAX])
        if n <= 0:
            raise OSError(errno.EIO, f"write moved {n} bytes after {pos} of {total}")
        pos += n


def _write_gathered(fd: int, views: List[memoryview]) -> None:
    """One writev(2) for several small pieces; a partial writev continues where it stopped."""
    i = 0
    while i < len(views):
        n = _writev(fd, views[i : i + IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, f"writev moved {n} bytes")
        while i < len(views) and n >= views[i].nbytes:  # pieces written whole
            n -= views[i].nbytes
            i += 1
        if n and i < len(views):  # a piece written in part: finish it alone, then gather again
            write_all(fd, views[i][n:])
            i += 1


def _fsync(fd: int, failure: List[BaseException]) -> None:
    try:
        os.fsync(fd)
    except BaseException as exc:  # reported by the writer
        failure.append(exc)


def write_file(path: Path, pieces: Sequence[Any], replace: bool = False) -> Tuple[int, str]:
    """Create `path` (or, with `replace`, truncate an existing regular file; never through a symlink)
    with `pieces` (buffers) in order, fsync it, check its size; returns (bytes, checksum).

    The checksum is computed while the fsync runs in a second thread: the CPU is busy copying into
    the page cache during the writes and idle while the disk flushes (xxhash and fsync both release
    the GIL). The pieces' memory must not change until this returns. Any failure raises OSError;
    the partial file is left for the caller to remove with its temporary folder."""
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    digest = xxhash.xxh3_128()
    mode = os.O_TRUNC if replace else os.O_EXCL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        gathered: List[memoryview] = []
        gathered_bytes = 0
        for v in views:
            if v.nbytes < GATHER_BELOW:
                gathered.append(v)
                gathered_bytes += v.nbytes
                if len(gathered) < IOV_MAX and gathered_bytes < GATHER_MAX_BYTES:
                    continue
                _write_gathered(fd, gathered)
                gathered, gathered_bytes = [], 0
            else:
                if gathered:
                    _write_gathered(fd, gathered)
                    gathered, gathered_bytes = [], 0
                write_all(fd, v)
        if gathered:
            _write_gathered(fd, gathered)
        failure: List[BaseException] = []
        if total > HASH_IN_THREAD_ABOVE:
            syncer = threading.Thread(target=_fsync, args=(fd, failure), name="ckpt-fsync", daemon=True)
            syncer.start()
            try:
                for v in views:
                    digest.update(v)
            finally:
                syncer.join()
        else:
            for v in views:
                digest.update(v)
            _fsync(fd, failure)
        if failure:
            raise failure[0]
        size = os.fstat(fd).st_size
        if size != total:
            raise OSError(errno.EIO, f"{path}: {size} bytes on disk after writing {total} (a short write)")
    finally:
        os.close(fd)
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
