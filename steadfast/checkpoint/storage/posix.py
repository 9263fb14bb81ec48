"""Checkpoints in a folder of a filesystem (checkpoint.dir=/some/folder, or the run folder's
checkpoints/): the store every run had before there were others.

A save is written into `.tmp-step_N-<id>/` (fileio: every byte, size checked), its manifest last;
then the files not yet durable, the manifest and the folder are fsynced side by side (one journal
commit), the fence runs, and the folder is renamed to `step_N` (atomic): committed. A committed
`step_N` already there is moved aside first, never deleted; one without a manifest (a crash's
leftover) goes to the trash. `settle` fsyncs the parent, so the rename is durable before retention
removes anything older. Discarding renames to `.trash-*` (invisible at once), then removes. Reading
opens the checkpoint's folder with O_NOFOLLOW and every file relative to it (fileio): a symlinked
folder is never listed as committed, a symlinked file or a FIFO is never read.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import fileio
from .base import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TMP_PREFIX,
    TRASH_PREFIX,
    Batch,
    FileCheckError,
    Files,
    Store,
    StoreError,
    register,
    set_aside_name,
    step_dir_name,
    step_of,
    unique,
)

log = logging.getLogger(__name__)
# what rename(2) of a folder answers when its target is taken: a folder with files (a committed checkpoint,
# a crash's leftover), or something that is not a folder
_TAKEN = frozenset({errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR})


class FolderFiles(Files):
    """The files of a committed checkpoint folder, opened without following links and checked to be
    regular files of the manifest's size; a file already read whole (and verified) is served from
    memory (`hold`), so a rank that verified its own file does not read it twice."""

    def __init__(self, folder: Path, sizes: Dict[str, int]) -> None:
        self.folder, self.sizes = folder, sizes
        self.dir_fd = fileio.open_folder(folder)
        self._fds: Dict[str, int] = {}
        self._held: Dict[str, memoryview] = {}

    def where(self, name: str) -> str:
        return str(self.folder / name)

    def hold(self, name: str, data: Any) -> None:
        self._held[name] = memoryview(data)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if name not in self.sizes:
                raise FileCheckError(f"{self.folder / name}: not in the manifest", "missing")
            fd, actual = fileio.open_regular(name, self.dir_fd, self.folder / name)
            if actual != self.sizes[name]:
                os.close(fd)
                raise FileCheckError(
                    f"{self.folder / name}: size is {actual} bytes, the manifest says {self.sizes[name]}", "size"
                )
            self._fds[name] = fd
        return fd

    def size(self, name: str) -> int:
        self._fd(name)
        return self.sizes[name]

    def read(self, name: str, offset: int, length: int) -> Any:
        held = self._held.get(name)
        if held is not None:
            if offset + length > held.nbytes:
                raise FileCheckError(f"{self.folder / name}: ended before byte {offset + length}", "size")
            return held[offset : offset + length]
        fd, buf = self._fd(name), bytearray(length)
        view, pos = memoryview(buf), 0
        while pos < length:
            n = os.preadv(fd, [view[pos:]], offset + pos)
            if n <= 0:
                raise FileCheckError(f"{self.folder / name}: ended before byte {offset + length}", "size")
            pos += n
        return buf

    def read_verified(self, name: str, size: int, checksum: str) -> bytearray:
        return fileio.read_verified(self.folder / name, size, checksum, self.dir_fd)

    def verify(self, name: str, size: int, checksum: Optional[str]) -> None:
        path = self.folder / name
        if checksum is not None:
            fileio.verify_file(path, size, checksum, self.dir_fd)
            return
        fd, actual = fileio.open_regular(name, self.dir_fd, path)
        os.close(fd)
        if actual != size:
            raise FileCheckError(f"{path}: size is {actual} bytes, the manifest says {size}", "size")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._held.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


@register
class FolderStore(Store):
    scheme = ""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.folder = Path(location)
        # A save's paths are joined as strings under this (a Path join costs a few µs each, ten a save)
        self._under = os.path.join(str(self.folder), "")

    def where(self, name: str = "") -> str:
        if "/" in name or name in ("", "."):  # not one plain name: as the path has it
            return str(self.folder / name) if name else str(self.folder)
        return self._under + name  # what `self.folder / name` prints, without a Path made each call

    # ---- writing --------------------------------------------------------------------------------
    def prepare(self) -> None:
        probe = self.folder / f"{TMP_PREFIX}probe-{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"checkpoint folder {self.folder} is not writable: {exc}") from exc
        self._remove_leftovers((TRASH_PREFIX, TMP_PREFIX))

    def stage(self, step: int) -> str:
        staged = unique(TMP_PREFIX, step_dir_name(step))
        os.mkdir(self._under + staged)
        return staged

    def batch(self) -> Batch:
        return fileio.Unsynced()

    def write(
        self, staged: str, file: str, pieces: Sequence[Any], batch: Optional[Batch] = None, verify: bool = False
    ) -> Tuple[int, str]:
        path = f"{self._under}{staged}/{file}"
        size, digest = fileio.write_file(path, pieces, later=batch if isinstance(batch, fileio.Unsynced) else None)
        if verify:
            fileio.verify_file(Path(path), size, digest)  # read back before it is reported written
        return size, digest

    def commit(self, staged: str, step: int, manifest: bytes, batch: Batch, fence: Any = None) -> Tuple[str, Optional[str]]:
        name = step_dir_name(step)
        tmp, final = self._under + staged, self._under + name
        unsynced = batch if isinstance(batch, fileio.Unsynced) else fileio.Unsynced()
        fileio.write_file(f"{tmp}/{MANIFEST}", [manifest], later=unsynced)
        unsynced.sync(tmp)
        if fence is not None:
            fence()  # the orphan fence, right before the rename that commits
        try:  # nothing there (every save but a re-save of a step): one rename, no probe before it
            os.rename(tmp, final)
            return name, None
        except OSError as exc:
            if exc.errno not in _TAKEN:
                raise
        # something is there (an empty folder would have been replaced, as it is moved away below)
        replaced, trash = None, None
        if os.path.lexists(f"{final}/{MANIFEST}"):  # committed (usable or not): kept, under another name
            replaced = self.set_aside(name, "replaced")
        elif os.path.lexists(final):  # no manifest: the leftover of a crash, never committed
            trash = self._under + unique(TRASH_PREFIX, name)
            os.rename(final, trash)
        os.rename(tmp, final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return name, replaced

    def settle(self) -> None:
        fileio.fsync_dir(self.folder)  # the rename that committed it, durable

    def abandon(self, staged: str) -> None:
        shutil.rmtree(self.folder / staged, ignore_errors=True)

    # ---- reading --------------------------------------------------------------------------------
    def names(self) -> List[str]:
        try:
            children = list(os.scandir(self.folder))
        except OSError:
            return []
        return [c.name for c in children if step_of(c.name) is not None and self._has_manifest(c)]

    @staticmethod
    def _has_manifest(entry: "os.DirEntry[str]") -> bool:
        # a symlinked folder is not listed as committed; whether it is a folder comes with the listing
        # (the entry's type: no lstat where the filesystem records it)
        try:
            return entry.is_dir(follow_symlinks=False) and os.path.lexists(f"{entry.path}/{MANIFEST}")
        except OSError:
            return False

    def read_manifest(self, name: str) -> bytes:
        where = self.folder / name
        dir_fd = fileio.open_folder(where)
        try:
            return fileio.read_small(MANIFEST, dir_fd, where / MANIFEST, MAX_MANIFEST_BYTES)
        finally:
            os.close(dir_fd)

    def open(self, name: str, sizes: Dict[str, int]) -> Files:
        return FolderFiles(self.folder / name, sizes)

    # ---- lifecycle ------------------------------------------------------------------------------
    def set_aside(self, name: str, reason: str) -> str:
        target = set_aside_name(name, reason)
        (self.folder / name).rename(self.folder / target)
        return target

    def discard(self, name: str) -> None:
        trash = self.folder / unique(TRASH_PREFIX, name)
        (self.folder / name).rename(trash)  # invisible at once, even if the removal below is interrupted
        shutil.rmtree(trash, ignore_errors=True)
        self._remove_leftovers((TRASH_PREFIX,))

    def _remove_leftovers(self, prefixes: Tuple[str, ...]) -> None:
        for child in self.folder.iterdir():
            if child.name.startswith(prefixes):
                log.info("Removing leftover %s", child)
                shutil.rmtree(child, ignore_errors=True)

    def problem(self) -> Optional[str]:
        """Checked before any worker starts, so a run cannot train for hours and then fail to save.
        Creates nothing that was not there: a refused launch leaves no empty folders behind."""
        folder = self.folder
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            return f"checkpoint folder {folder}: {existing} is not a folder; choose another checkpoint.dir"
        try:
            fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return f"checkpoint folder {folder} is not writable ({exc.strerror or exc}); choose a writable checkpoint.dir"
        return None
