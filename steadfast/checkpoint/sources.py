"""Where a checkpoint's bytes are read from, a range at a time: a committed checkpoint's files in its
store (storage.base.Files), or buffers in memory (a snapshot). Readers of formats that need only part
of a file (the sharded one, on another world size) read through these."""

from __future__ import annotations

from typing import Any, Dict, Protocol

from .tensorformat import TensorFileError


class Source(Protocol):
    """Where a checkpoint's files are (a committed checkpoint's Files, a snapshot in memory)."""

    def size(self, name: str) -> int: ...

    def read(self, name: str, offset: int, length: int) -> Any:
        """`length` bytes at `offset` of file `name`: a writable buffer (a tensor may be made over it)."""


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
