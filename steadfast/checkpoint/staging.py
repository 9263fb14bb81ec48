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
CheckpointManager.wait_staging() first. (DCP's word, staging; "snapshot" is the memory tier's: memory.py.)
"""

from __future__ import annotations

import ctypes
import threading
from itertools import compress
from operator import attrgetter, not_
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from .shards import is_dtensor
from .tensorwrite import GATHER_BELOW, GATHER_MAX, Entry, Layout, flat_bytes, gathered

Key = Tuple[bool, int]  # (on a GPU, address of the first element) of a tensor
# Bytes a memmove copies in the time one owned tensor's key is read (about a microsecond, its
# memory cold after a training step): below that many per owned tensor, the rest is copied now.
KEY_WORTH_BYTES = 16 * 1024


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_TENSOR_OF, _IS_CUDA = attrgetter("tensor"), attrgetter("is_cuda")


def _keys(tensors: List[torch.Tensor]) -> Set[Key]:
    """Their keys (a DTensor's: its local piece's, what a save copies). An empty tensor's key matches
    only empty tensors', which a save copies nothing of."""
    plain = (_TENSOR, _PARAMETER)
    pieces = [t.to_local() for t in tensors if t.__class__ not in plain and is_dtensor(t)]  # type: ignore[attr-defined]
    return {(t.is_cuda, t.data_ptr()) for t in tensors if t.__class__ in plain or not is_dtensor(t)} | {
        (t.is_cuda, t.data_ptr()) for t in pieces
    }


class Owned:
    """The tensors only the optimizers' step() changes: their parameters and their state. A save's
    tensor is told by identity (a module's state holds its parameters themselves: codec.state_of),
    else by its memory (a detached view, a DTensor's local piece), whose keys are read only then, and
    only when what they would defer is worth it (split): an async save's blocking part asks this of
    every tensor of the state."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.tensors: List[torch.Tensor] = []
        for opt in optimizers:
            for group in opt.param_groups:
                self.tensors.extend(group["params"])
            for state in opt.state.values():
                if isinstance(state, dict):
                    self.tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        self.ids = set(map(id, self.tensors))
        self._keys: Optional[Set[Key]] = None

    def __contains__(self, t: torch.Tensor) -> bool:
        if id(t) in self.ids:
            return True
        if not self.tensors:
            return False
        if self._keys is None:
            self._keys = _keys(self.tensors)
        return (t.is_cuda, t.data_ptr()) in self._keys

    def split(self, entries: List[Entry]) -> Tuple[List[Entry], List[Entry]]:
        """(copied now, copied later) of a file's entries: by identity in a few C-level passes (a
        module's own parameters), by memory for the rest, unless the rest is so small that copying it
        now costs less than reading every owned tensor's address would (an RNG's state beside
        thousands of parameters): copied now is always right, only later needs the proof."""
        owned = list(map(self.ids.__contains__, map(id, map(_TENSOR_OF, entries))))
        if not all(owned) and self.tensors:
            rest = sum(e.end - e.begin for known, e in zip(owned, entries) if not known)
            if rest > len(self.tensors) * KEY_WORTH_BYTES:
                owned = [known or e.tensor in self for known, e in zip(owned, entries)]
        now = list(compress(entries, map(not_, owned)))
        return now, list(compress(entries, owned))


def optimizer_owned(objects: Iterable[Any]) -> Tuple[List[torch.optim.Optimizer], Owned]:
    """The optimizers among `objects`, and the tensors only their step() changes."""
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    return optimizers, Owned(optimizers)


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
    """Copy the entries' tensors to their places in `dst`: host tensors with one memmove each (no
    torch dispatch), small device tensors adjacent in the file together (one copy a run)."""
    base = dst.data_ptr()
    run: List[Entry] = []
    for e in entries:
        t = e.tensor
        if e.end == e.begin:
            continue
        if t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            ctypes.memmove(base + e.begin, t.data_ptr(), e.end - e.begin)
        elif t.is_cuda and e.end - e.begin < GATHER_BELOW:
            if run and (run[-1].end != e.begin or run[-1].tensor.device != t.device or e.end - run[0].begin > GATHER_MAX):
                _copy_run(run, dst)
                run = []
            run.append(e)
        else:
            dst[e.begin : e.end].copy_(flat_bytes(t), non_blocking=t.is_cuda)
    if run:
        _copy_run(run, dst)


def _copy_run(run: List[Entry], dst: torch.Tensor) -> None:
    dst[run[0].begin : run[-1].end].copy_(gathered(run), non_blocking=True)  # the stream is synchronized before use


class Staging:
    """One save's tensor data in host memory: copied now, or later but before the next optimizer step."""

    def __init__(self, layouts: Dict[str, Layout], buffers: HostBuffers, deferred: Optional[Owned]) -> None:
        self.layouts = layouts
        self.data: Dict[str, torch.Tensor] = {}
        self._later: List[Tuple[str, List[Entry], List[Entry]]] = []  # (file, copied now, copied later)
        self.copied = threading.Event()
        gpu: Optional[torch.device] = None
        parts: List[Tuple[str, List[Entry], List[Entry]]] = []  # (file, copied now, copied later)
        # no tensor is on a GPU in a process that has not initialized CUDA (a pass over every tensor saved)
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        for name, layout in layouts.items():
            entries = layout.entries
            if gpu is None and cuda and any(map(_IS_CUDA, map(_TENSOR_OF, entries))):
                gpu = next(e.tensor.device for e in entries if e.tensor.is_cuda)
            now, later = deferred.split(entries) if deferred is not None else (entries, [])
            parts.append((name, now, later))
        self._device = gpu
        self._ready: Optional[Any] = None
        for name, now, later in parts:
            dst = buffers.get(name, layouts[name].data_bytes, pinned=gpu is not None)
            self.data[name] = dst
            _copy(now, dst)
            if later:
                self._later.append((name, now, later))
        if gpu is not None:
            stream = torch.cuda.current_stream(gpu)
            if self._later:  # the background copies start after what the training stream has queued
                self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._ready.record(stream)
            stream.synchronize()  # the copies made now have landed
        if not self._later:
            self.copied.set()

    def copy_rest(self) -> None:
        """(background thread) Copy the deferred tensors, each file's layout checked first where its
        plan did not read their dtypes and shapes (reuse.py); always releases waiters, even on failure."""
        try:
            rest = [(self._checked(name, now, later), self.data[name]) for name, now, later in self._later]
            if rest and self._ready is not None:
                # device=: this thread's current device may be another
                stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
                stream.wait_event(self._ready)
                with torch.cuda.device(self._device), torch.cuda.stream(stream):
                    for entries, dst in rest:
                        _copy(entries, dst)
                stream.synchronize()
            else:
                for entries, dst in rest:
                    _copy(entries, dst)
        finally:
            self._later = []
            self.copied.set()

    def _checked(self, name: str, now: List[Entry], later: List[Entry]) -> List[Entry]:
        """The entries still to copy of file `name`, once its layout holds: where a tensor's dtype or shape
        changed since it was planned, the file is placed anew in a new buffer, the bytes copied at the
        save's call moved to their new places (the tensors they came from may have changed since)."""
        old = self.layouts[name]
        if old.recheck is None:
            return later
        layout = old.recheck()
        old.recheck = None
        if layout is old:
            return later
        held, at = self.data[name], {e.name: e for e in old.entries}
        dst = torch.empty(max(layout.data_bytes, 1), dtype=torch.uint8, pin_memory=self._device is not None)
        dst = dst[: layout.data_bytes]
        copied = {e.name for e in now}
        rest = []
        for e in layout.entries:
            if e.name in copied:
                was = at[e.name]
                dst[e.begin : e.end].copy_(held[was.begin : was.end])
            else:
                rest.append(e)
        self.layouts[name], self.data[name] = layout, dst
        return rest

    def pieces(self, name: str) -> List[Any]:
        return [self.layouts[name].header(), self.data[name].numpy()]
