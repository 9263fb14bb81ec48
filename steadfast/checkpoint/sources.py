"""Where a checkpoint's bytes are read from, a range at a time: a committed folder on disk, or
buffers in memory (a snapshot). Readers of formats that need only part of a file (the sharded one,
on another world size) read through these."""

from __future__ import annotations

import os
from typing import Any, Dict, Protocol

from . import fileio
from .tensorformat import TensorFileError


class Source(Protocol):
    """Where a checkpoint's files are (a committed folder, a snapshot in memory)."""

    def size(self, name: str) -> int: ...

    def read(self, name: str, offset: int, length: int) -> Any:
        """`length` bytes at `offset` of file `name`: a writable buffer (a tensor may be made over it)."""


class FolderSource:
    """The files of a committed checkpoint folder, opened without following links and checked to be
    regular files of the manifest's size; a file already read whole (and verified) is served from
    memory (`hold`), so a rank that verified its own file does not read it twice."""

    def __init__(self, dir_fd: int, where: Any, sizes: Dict[str, int]) -> None:
        self.dir_fd, self.where, self.sizes = dir_fd, where, sizes
        self._fds: Dict[str, int] = {}
        self._held: Dict[str, memoryview] = {}

    def hold(self, name: str, data: bytearray) -> None:
        self._held[name] = memoryview(data)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if name not in self.sizes:
                raise TensorFileError(f"{self.where / name}: not in the manifest", "missing")
            fd, actual = fileio.open_regular(name, self.dir_fd, self.where / name)
            if actual != self.sizes[name]:
                os.close(fd)
                raise TensorFileError(
                    f"{self.where / name}: size is {actual} bytes, the manifest says {self.sizes[name]}", "size"
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
                raise TensorFileError(f"{self.where / name}: ended before byte {offset + length}", "size")
            return held[offset : offset + length]
        fd, buf = self._fd(name), bytearray(length)
        view, pos = memoryview(buf), 0
        while pos < length:
            n = os.preadv(fd, [view[pos:]], offset + pos)
            if n <= 0:
                raise TensorFileError(f"{self.where / name}: ended before byte {offset + length}", "size")
            pos += n
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._held.clear()


class BufferSource:
    """Files held in memory (a snapshot): name -> bytes."""

    def __init__(self, files: Dict[str, Any]) -> None:
        self.files = {name: memoryview(data).cast("B") for name, data in files.items()}  # writable buffers

    def size(self, name: str) -> int:
        if name not in self.files:
            raise TensorFileError(f"{name}: not in this snapshot", "missing")
        return self.files[name].nbytes

    def read(self, name: str, offset: int, length: int) -> Any:
        view = self.files[name]
        if offset + length > view.nbytes:
            raise TensorFileError(f"{name}: ends before byte {offset + length}", "size")
        return view[offset : offset + length]
