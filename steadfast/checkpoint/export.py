"""One plain safetensors file of a whole model, written a tensor at a time, so no process ever holds
more than one whole tensor: from a live sharded model at the end of a run (every rank gathers each
tensor in turn, rank 0 writes it) and from a sharded checkpoint (`python -m steadfast.consolidate`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .shards import is_dtensor
from .storage import fileio
from .tensorformat import DTYPES
from .tensorwrite import Entry, Layout, _place, _Planner


class Writer:
    """A safetensors file whose tensors (name, dtype code, shape) are known before their values:
    the header is written first, each tensor at its place as it comes, then the file is committed
    (fsync, rename over `path`, folder fsync)."""

    def __init__(self, path: Path, tensors: Iterable[Tuple[str, str, Tuple[int, ...]]]) -> None:
        entries: List[Entry] = []
        for name, code, shape in sorted(tensors):
            planner = _Planner()
            planner.tensor(torch.empty(shape, dtype=DTYPES[code], device="meta"), name)
            entries.append(planner.entries[0])
        layout = Layout(None, entries, _place(entries))
        header = layout.header()
        self.path, self.size = Path(path), len(header) + layout.data_bytes
        self.offsets: Dict[str, Tuple[int, int]] = {e.name: (len(header) + e.begin, e.end - e.begin) for e in entries}
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.fd: Optional[int] = os.open(self.tmp, flags, 0o644)
        os.ftruncate(self.fd, self.size)
        self._pwrite(header, 0)

    def _pwrite(self, data: Any, offset: int) -> None:
        assert self.fd is not None
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self.fd, view, offset)
            if n <= 0:
                raise OSError(f"{self.tmp}: a write moved nothing")
            view, offset = view[n:], offset + n

    def put(self, name: str, tensor: torch.Tensor) -> None:
        offset, nbytes = self.offsets[name]
        t = tensor.detach().cpu().contiguous().reshape(-1)
        if t.numel() * t.element_size() != nbytes:
            raise ValueError(f"{name}: {t.numel() * t.element_size()} bytes, the header says {nbytes}")
        if nbytes:
            self._pwrite(t.view(torch.uint8).numpy(), offset)

    def commit(self) -> None:
        assert self.fd is not None
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None
        os.replace(self.tmp, self.path)
        fileio.fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.tmp.unlink(missing_ok=True)


def write(
    path: Path, tensors: Iterable[Tuple[str, str, Tuple[int, ...]]], value: Callable[[str], torch.Tensor], writes: bool = True
) -> None:
    """Write the tensors (name, dtype code, shape) to `path`, asking `value(name)` for each in turn
    (`writes`: this process writes; others only answer value(), which may be collective)."""
    listed = list(tensors)
    writer = Writer(path, listed) if writes else None
    try:
        for name, _, _ in listed:
            tensor = value(name)
            if writer is not None:
                writer.put(name, tensor)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()


def export_model(state_dict: Dict[str, Any], path: Path, writes: bool) -> None:
    """Collective when the state holds DTensors: the model's whole state as one safetensors file,
    gathered a tensor at a time (every rank calls it; only the one with `writes` writes)."""
    from .tensorformat import CODES

    listed = [(name, CODES[t.dtype], tuple(int(d) for d in t.shape)) for name, t in state_dict.items()]

    def whole(name: str) -> torch.Tensor:
        t: torch.Tensor = state_dict[name]
        return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]

    write(path, listed, whole, writes)
