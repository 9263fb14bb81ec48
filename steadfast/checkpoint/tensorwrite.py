"""Writing checkpoint files (the format: tensorformat): a Layout says where every tensor goes before
anything is written; the bytes go straight from the tensors' memory to the file (fileio)."""

from __future__ import annotations

import ctypes
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from .shards import is_dtensor
from .storage import fileio
from .tensorformat import (
    ALIGN,
    CODES,
    FORMAT_META,
    ITEMSIZE,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    MAX_HEADER_VALUES,
    TREE_KEY,
    gc_paused,
    json_values,
)


class Entry:
    """One tensor of a file: its name, dtype code, shape, span in the data and the tensor itself (and
    which tensor of the state it came from, in the planner's order: what a reused plan rebinds)."""

    __slots__ = ("name", "code", "shape", "begin", "end", "tensor", "leaf")

    def __init__(
        self, name: str, code: str, shape: Tuple[int, ...], begin: int, end: int, tensor: torch.Tensor, leaf: int = -1
    ) -> None:
        self.name, self.code, self.shape, self.begin, self.end, self.tensor = name, code, shape, begin, end, tensor
        self.leaf = leaf


@dataclass
class Layout:
    """Where every tensor of one state goes in its file, before anything is written."""

    skeleton: Any
    entries: List[Entry]
    data_bytes: int
    metadata: Optional[Dict[str, str]] = None
    _header: Optional[bytes] = field(default=None, repr=False)
    _copies: List[torch.Tensor] = field(default_factory=list, repr=False)
    _table: Optional[str] = field(default=None, repr=False)  # the header's tensor table (names, shapes, places)
    # a reused layout whose optimizer-owned tensors' dtypes and shapes are not checked yet (reuse.py):
    # called before they are copied, it returns the layout that holds (this one, or one placed anew)
    recheck: Optional[Callable[[], "Layout"]] = field(default=None, repr=False)

    def header(self) -> bytes:
        """The length prefix and the padded JSON header (built once)."""
        if self._header is None:
            with gc_paused():
                self._header = self._build_header()
        return self._header

    def _build_header(self) -> bytes:
        meta = dict(FORMAT_META)
        if self.skeleton is not None:
            meta[TREE_KEY] = json.dumps(self.skeleton, separators=(",", ":"))
        if self.metadata:
            meta.update(self.metadata)
        # The tensor table, formatted directly (json.dumps of a dict per tensor costs twice as much);
        # names that need escaping go through json.dumps (one check for all: most need none).
        parts = [f'{{"__metadata__":{json.dumps(meta, separators=(",", ":"))}']
        if self._table is None:
            self._table = self._tensor_table()
        if self.entries:
            parts.append(self._table)
        text = ",".join(parts).encode() + b"}"
        padded = len(text) + (-(8 + len(text)) % ALIGN)
        values = json_values(text)
        if padded > MAX_HEADER_BYTES or values > MAX_HEADER_VALUES:
            raise ValueError(
                f"this state's header ({len(self.entries)} tensors) is {padded} bytes and {values} JSON "
                f"values; the loader accepts at most {MAX_HEADER_BYTES} bytes and {MAX_HEADER_VALUES} "
                "values: split the state into more objects"
            )
        return padded.to_bytes(8, "little") + text + b" " * (padded - len(text))

    def _tensor_table(self) -> str:
        parts = []
        plain = _PLAIN_NAME.fullmatch("".join(e.name for e in self.entries)) is not None
        for e in self.entries:
            name = e.name if plain or _PLAIN_NAME.fullmatch(e.name) else json.dumps(e.name)[1:-1]
            shape = ",".join(map(str, e.shape))
            parts.append(f'"{name}":{{"dtype":"{e.code}","shape":[{shape}],"data_offsets":[{e.begin},{e.end}]}}')
        return ",".join(parts)

    def built(self) -> Tuple[Optional[bytes], Optional[str]]:
        """(the header, the tensor table's text), each if built already: a reused layout shares them."""
        return self._header, self._table

    @property
    def size(self) -> int:
        return len(self.header()) + self.data_bytes

    def buffers(self) -> List[Any]:
        """The file's bytes as buffers straight over the tensors' memory (host copies of device or
        strided tensors, kept alive by this layout; small device tensors come over together, one copy
        a run: see gathered). The tensors must live until the write is done."""
        assert self.recheck is None, "a layout not checked yet is staged (staging.Staging), never written directly"
        out: List[Any] = [self.header()]
        self._copies = []
        run: List[Entry] = []
        with gc_paused():
            for e in self.entries:
                if e.end == e.begin:
                    continue
                t = e.tensor
                if t.is_cuda and e.end - e.begin < GATHER_BELOW:  # entries are in file order: a run is adjacent
                    if run and (run[-1].tensor.device != t.device or e.end - run[0].begin > GATHER_MAX):
                        out.append(self._host(gathered(run)))
                        run = []
                    run.append(e)
                    continue
                if run:
                    out.append(self._host(gathered(run)))
                    run = []
                if not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
                    t = flat_bytes(t).cpu()
                out.append(self._host(t))
            if run:
                out.append(self._host(gathered(run)))
        return out

    def _host(self, t: torch.Tensor) -> Any:
        """A buffer over `t`'s bytes in host memory (`t` kept alive while the layout is)."""
        if not t.is_cpu:
            t = t.cpu()
        self._copies.append(t)
        return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


GATHER_BELOW = 1 << 20  # device tensors smaller than this come to the host together, one copy per run
GATHER_MAX = 64 << 20  # the most device memory a run takes while it is gathered


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a flat, contiguous tensor of bytes, on its device."""
    return t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def gathered(run: List[Entry]) -> torch.Tensor:
    """The bytes of a run of tensors adjacent in the file, on their device, in one tensor: one
    kernel gathers them, and one copy brings them to the host, where one each cost a copy (and a
    synchronization, for a synchronous save) per tensor."""
    if len(run) == 1:
        return flat_bytes(run[0].tensor)
    return torch.cat([flat_bytes(e.tensor) for e in run])


_STRIDED = torch.strided
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.#/ -]*")  # needs no escaping in JSON
_PLAIN = frozenset({int, float, bool, str, type(None)})  # values `encode` keeps as they are


class _Planner:
    """Walks a state once: its skeleton (copies of every non-tensor value) and its tensors' entries.
    Tensors are named by their dotted path in the state; a path is also what an error names. Each
    tensor and numpy array of the state is counted (`seen`), in order: an entry records its own."""

    def __init__(self) -> None:
        self.entries: List[Entry] = []
        self.names: Set[str] = {"__metadata__"}
        self.seen = -1

    def tensor(self, t: torch.Tensor, path: str) -> str:
        # This runs once per tensor of every save and snapshot (thousands for a model of many small
        # tensors), so it avoids calls it can: a plain tensor or Parameter is told by its class.
        cls = t.__class__
        if cls is not _TENSOR and cls is not _PARAMETER and is_dtensor(t):
            raise TypeError(f"{path or 'the top'} is a sharded tensor (DTensor): only the sharded format stores those")
        code = CODES.get(t.dtype)  # quantized dtypes are not there
        if code is None or t.layout is not _STRIDED:
            raise TypeError(
                f"cannot store a tensor of dtype {t.dtype} and layout {t.layout} at {path or 'the top'} "
                f"(safetensors stores strided tensors of {', '.join(str(d).removeprefix('torch.') for d in CODES)})"
            )
        name = path or "tensor"
        names = self.names
        if name in names:
            k = 1
            while f"{name}#{k}" in names:
                k += 1
            name = f"{name}#{k}"
        names.add(name)
        self.entries.append(Entry(name, code, t.shape, 0, t.nbytes, t, self.seen))
        return name

    def leaf(self, t: torch.Tensor, path: str) -> Any:
        """The skeleton's node for the tensor `t` at `path` (here: stored in this file)."""
        return {"__t": self.tensor(t, path)}

    def encode(self, obj: Any, path: str, depth: int) -> Any:
        if isinstance(obj, torch.Tensor):
            self.seen += 1
            return self.leaf(obj, path)
        if depth >= MAX_DEPTH:
            raise TypeError(f"the state is nested deeper than {MAX_DEPTH} levels at {path}")
        prefix = f"{path}." if path else ""
        if isinstance(obj, dict):
            items: List[Any] = []
            leaf, append = self.leaf, items.append
            for k, v in obj.items():
                if k.__class__ is not str and (not isinstance(k, (str, int)) or isinstance(k, bool)):
                    raise TypeError(f"cannot store a dict key of type {type(k).__name__} at {path or 'the top'}")
                cls = v.__class__
                if cls is _TENSOR or cls is _PARAMETER or isinstance(v, torch.Tensor):  # without a call of encode
                    self.seen += 1
                    append([k, leaf(v, f"{prefix}{k}")])
                else:
                    append([k, self.encode(v, f"{prefix}{k}", depth + 1)])
            return {"__d": items}
        if isinstance(obj, (list, tuple)):
            if all(v.__class__ in _PLAIN for v in obj):  # python's RNG state: 625 ints, each its own node
                nodes = list(obj)
            else:
                nodes = [self.encode(v, f"{prefix}{i}", depth + 1) for i, v in enumerate(obj)]
            return {"__tuple": nodes} if isinstance(obj, tuple) else nodes
        if isinstance(obj, np.ndarray):
            self.seen += 1
            try:
                t = torch.from_numpy(np.ascontiguousarray(obj))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"cannot store a numpy array of dtype {obj.dtype} at {path}: {exc}") from None
            return {"__n": self.tensor(t, path)}
        if isinstance(obj, np.generic):
            return obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot store an object of type {type(obj).__name__} at {path or 'the top'} in a checkpoint")


def _place(entries: List[Entry]) -> int:
    """Order by element size, largest first (stable), so every span starts aligned; returns the data size."""
    entries.sort(key=lambda e: -ITEMSIZE[e.code])
    offset = 0
    for e in entries:
        n = e.end
        e.begin, e.end = offset, offset + n
        offset += n
    return offset


def plan(tree: Any) -> Layout:
    """The layout of `tree`'s file; the skeleton holds copies of every non-tensor value."""
    planner = _Planner()
    with gc_paused():
        skeleton = planner.encode(tree, "", 0)
    data_bytes = _place(planner.entries)
    return Layout(skeleton, planner.entries, data_bytes)


def save(tree: Any, path: Path) -> Tuple[int, str]:
    """Write `tree` to `path` (replacing a file there) and fsync it; returns (size in bytes, "xxh3_128:<hex>")."""
    layout = plan(tree)  # held until the write is done: its buffers point into tensors it keeps alive
    return fileio.write_file(path, layout.buffers(), replace=True)


def export_safetensors(state_dict: Dict[str, torch.Tensor], path: Path) -> Tuple[int, str]:
    """Write a plain safetensors file (name -> tensor, no skeleton) atomically: a temporary file in
    the same folder, fsynced, renamed over `path`, folder fsynced. Returns (size, checksum)."""
    path = Path(path)
    entries = []
    for name, t in state_dict.items():
        if not isinstance(name, str) or name == "__metadata__" or not isinstance(t, torch.Tensor):
            raise TypeError(f"export_safetensors needs str -> tensor (not '__metadata__'); got {name!r}: {type(t).__name__}")
        planner = _Planner()
        planner.tensor(t, name)
        entries.append(planner.entries[0])
    entries.sort(key=lambda e: e.name)
    layout = Layout(None, entries, _place(entries))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        result = fileio.write_file(tmp, layout.buffers())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fileio.fsync_dir(path.parent)
    return result
