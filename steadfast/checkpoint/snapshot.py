"""The blocking part of an asynchronous save: a copy of the state's tensors into reused host memory.

Every file's tensor data is copied into one host buffer laid out as the file's data (see
tensorfile.Layout), so the background thread writes each file with a few large writes. The buffers
are reused from one save to the next: fresh allocations cost more than the copy (page faults).

Tensors that only an optimizer's step() changes (its parameters and its state: the model's weights,
Adam's moments) need not be copied before save() returns, only before that optimizer's next step():
the copy of those runs in the background, overlapping the next forward and backward pass, and a
step pre-hook on each optimizer waits for it (`wait_copied`). Everything else (buffers such as
BatchNorm's running statistics, which the forward pass changes; any state not owned by an optimizer)
is copied before save() returns. This assumes parameters change only in optimizer.step() between
two saves, which is what a training loop does; code that changes them elsewhere calls
CheckpointManager.wait_snapshot() first.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from .shards import is_dtensor
from .tensorwrite import Entry, Layout

Key = Tuple[bool, int]  # (on a GPU, address of the first element) of a tensor


def _key(t: torch.Tensor) -> Key:
    if type(t) is not torch.Tensor and is_dtensor(t):  # a sharded tensor: its piece on this rank is what is copied
        t = t.to_local()  # type: ignore[attr-defined]
    return (t.is_cuda, t.data_ptr())


def optimizer_owned(objects: Iterable[Any]) -> Tuple[List[torch.optim.Optimizer], Set[Key]]:
    """The optimizers among `objects`, and the tensors only their step() changes."""
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    owned: Set[Key] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            owned.update(_key(p) for p in group["params"] if p.numel())
        for state in opt.state.values():
            if isinstance(state, dict):
                owned.update(_key(v) for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
    return optimizers, owned


class HostBuffers:
    """One host buffer per file name, grown when a state grows, pinned when the state is on a GPU."""

    def __init__(self) -> None:
        self._buffers: Dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or (pinned and not buf.is_pinned()):
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self._buffers[name] = buf
        return buf[:nbytes]


def _copy(entries: List[Entry], dst: torch.Tensor) -> None:
    base = dst.data_ptr()
    for e in entries:
        t = e.tensor
        if e.end == e.begin:
            continue
        if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            ctypes.memmove(base + e.begin, t.data_ptr(), e.end - e.begin)  # no per-tensor torch dispatch
        else:
            src = t.detach().resolve_conj().resolve_neg()
            src = src.reshape(-1) if src.is_contiguous() else src.contiguous().reshape(-1)
            dst[e.begin : e.end].copy_(src.view(torch.uint8), non_blocking=src.is_cuda)


class Snapshot:
    """One save's tensor data in host memory: copied now, or later but before the next optimizer step."""

    def __init__(self, layouts: Dict[str, Layout], buffers: HostBuffers, deferred: Set[Key]) -> None:
        self.layouts = layouts
        self.data: Dict[str, torch.Tensor] = {}
        self._later: List[Tuple[List[Entry], torch.Tensor]] = []
        self.copied = threading.Event()
        gpu = next((e.tensor.device for layout in layouts.values() for e in layout.entries if e.tensor.is_cuda), None)
        on_gpu = gpu is not None
        self._device = gpu
        self._ready: Optional[Any] = None
        for name, layout in layouts.items():
            dst = buffers.get(name, layout.data_bytes, pinned=on_gpu)
            self.data[name] = dst
            now: List[Entry] = []
            later: List[Entry] = []
            for e in layout.entries:
                (later if (e.tensor.is_cuda, e.tensor.data_ptr()) in deferred else now).append(e)
            _copy(now, dst)
            if later:
                self._later.append((later, dst))
        if gpu is not None:
            stream = torch.cuda.current_stream(gpu)
            if self._later:  # the background copies start after what the training stream has queued
                self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._ready.record(stream)
            stream.synchronize()  # the copies made now have landed
        if not self._later:
            self.copied.set()

    def copy_rest(self) -> None:
        """(background thread) Copy the deferred tensors; always releases waiters, even on failure."""
        try:
            if self._later and self._ready is not None:
                # device=: this thread's current device may be another
                stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
                stream.wait_event(self._ready)
                with torch.cuda.device(self._device), torch.cuda.stream(stream):
                    for entries, dst in self._later:
                        _copy(entries, dst)
                stream.synchronize()
            else:
                for entries, dst in self._later:
                    _copy(entries, dst)
        finally:
            self._later = []
            self.copied.set()

    def pieces(self, name: str) -> List[Any]:
        return [self.layouts[name].header(), self.data[name].numpy()]
