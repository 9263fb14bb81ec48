"""The checkpoint file format: safetensors, with the state's structure in its metadata.

    u64 little-endian N | N bytes of JSON header (space-padded so the data starts 64-byte aligned) | data

The header is safetensors' own: per tensor `dtype` (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL,
U64, U32, U16, C64, F8_*), `shape` and `data_offsets` [begin, end) relative to the data, which the
tensors cover exactly, in order, without gaps; `__metadata__` is a string->string map. Ours holds
`steadfast.tree`: the state's skeleton as JSON (dicts with str or int keys, lists, tuples, numbers,
strings, None; tensors and numpy arrays as references to their names). Any safetensors reader
opens a checkpoint file: `safetensors.safe_open(path, "pt")` lists its tensors by the dotted path
of their place in the state (`net.0.weight`, `state.0.exp_avg`). Nothing is unpickled: a tampered
file can fail to load but cannot run code.

The loader enforces safetensors' rules, and refuses anything else as TensorFileError: a header of
at most MAX_HEADER_BYTES, UTF-8 JSON object without duplicate keys, known dtypes only, shapes of
non-negative ints, offsets sorted, contiguous and covering the data exactly, element count times
dtype size equal to each span; and, for the skeleton, a depth of at most MAX_DEPTH and only the
node kinds above. Tensors are ordered by element size (largest first), so each is aligned.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from . import fileio

_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U64": "uint64",
                "U32": "uint32", "U16": "uint16", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
                "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}
DTYPES: Dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)}
CODES: Dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
ITEMSIZE: Dict[str, int] = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in DTYPES.items()}
ALIGN = 64
# Parsing JSON into Python objects costs ~60-100 bytes per value, whatever the text: a crafted 8 MiB
# header of empty lists would cost ~180 MB. So the header is capped twice, before it is parsed: at
# 8 MiB (safetensors allows 100 MB; a state needs ~200 bytes per tensor with its skeleton, so this
# holds ~40,000 tensors per state object, far more than one writer process handles), and at
# MAX_HEADER_VALUES JSON values (counted as `,` `:` `[` `{`; ~16 per tensor), which bounds the parse
# to a few tens of MB.
MAX_HEADER_BYTES = 8 << 20
MAX_HEADER_VALUES = 600_000
MAX_DEPTH = 64  # state trees are a few levels deep (optimizer: 4); deeper is refused both ways
MAX_DIMS = 64
TREE_KEY = "steadfast.tree"
FORMAT_META = {"format": "pt"}  # what safetensors' torch writer puts there; some readers check it
CHECKSUM = fileio.CHECKSUM


class TensorFileError(fileio.FileCheckError):
    """The file is not a valid tensor file (truncated, damaged, or not ours)."""


def _error(name: str, what: str, reason: str = "format") -> TensorFileError:
    return TensorFileError(f"{name}: not a steadfast tensor file ({what}); refusing to load it", reason)


# ---- writing ---------------------------------------------------------------------------------------
class Entry:
    """One tensor of a file: its name, dtype code, shape, span in the data and the tensor itself."""

    __slots__ = ("name", "code", "shape", "begin", "end", "tensor")

    def __init__(self, name: str, code: str, shape: Tuple[int, ...], begin: int, end: int, tensor: torch.Tensor) -> None:
        self.name, self.code, self.shape, self.begin, self.end, self.tensor = name, code, shape, begin, end, tensor


@dataclass
class Layout:
    """Where every tensor of one state goes in its file, before anything is written."""

    skeleton: Any
    entries: List[Entry]
    data_bytes: int
    metadata: Optional[Dict[str, str]] = None
    _header: Optional[bytes] = field(default=None, repr=False)
    _copies: List[torch.Tensor] = field(default_factory=list, repr=False)

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
        # a name that needs escaping goes through json.dumps.
        parts = [f'{{"__metadata__":{json.dumps(meta, separators=(",", ":"))}']
        for e in self.entries:
            name = e.name if _PLAIN_NAME.fullmatch(e.name) else json.dumps(e.name)[1:-1]
            shape = ",".join(map(str, e.shape))
            parts.append(f'"{name}":{{"dtype":"{e.code}","shape":[{shape}],"data_offsets":[{e.begin},{e.end}]}}')
        text = ",".join(parts).encode() + b"}"
        padded = len(text) + (-(8 + len(text)) % ALIGN)
        values = json_values(text)
        if padded > MAX_HEADER_BYTES or values > MAX_HEADER_VALUES:
            raise ValueError(f"this state's header ({len(self.entries)} tensors) is {padded} bytes and {values} JSON "
                             f"values; the loader accepts at most {MAX_HEADER_BYTES} bytes and {MAX_HEADER_VALUES} "
                             "values: split the state into more objects")
        return padded.to_bytes(8, "little") + text + b" " * (padded - len(text))

    @property
    def size(self) -> int:
        return len(self.header()) + self.data_bytes

    def buffers(self) -> List[Any]:
        """The file's bytes as buffers straight over the tensors' memory (host copies of device or
        strided tensors, kept alive by this layout). The tensors must live until the write is done."""
        out: List[Any] = [self.header()]
        self._copies = []
        c_char = ctypes.c_char
        with gc_paused():
            for e in self.entries:
                if e.end == e.begin:
                    continue
                t = e.tensor
                if not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
                    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
                    self._copies.append(t)
                out.append((c_char * (e.end - e.begin)).from_address(t.data_ptr()))
        return out

    def copy_into(self, dst: torch.Tensor, entries: Optional[List[Entry]] = None) -> None:
        """Copy the tensors' bytes (all, or `entries`) into `dst`, a uint8 buffer of the data's size."""
        for e in self.entries if entries is None else entries:
            if e.end > e.begin:
                src = _flat_bytes(e.tensor)
                dst[e.begin : e.end].copy_(src, non_blocking=src.is_cuda)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg()
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)


_STRIDED = torch.strided
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.#/ -]*")  # needs no escaping in JSON


class _Planner:
    """Walks a state once: its skeleton (copies of every non-tensor value) and its tensors' entries.
    Tensors are named by their dotted path in the state; a path is also what an error names."""

    def __init__(self) -> None:
        self.entries: List[Entry] = []
        self.names: set = {"__metadata__"}

    def tensor(self, t: torch.Tensor, path: str) -> str:
        code = CODES.get(t.dtype)  # quantized dtypes are not there
        if code is None or t.layout is not _STRIDED:
            raise TypeError(f"cannot store a tensor of dtype {t.dtype} and layout {t.layout} at {path or 'the top'} "
                            f"(safetensors stores strided tensors of {', '.join(str(d).removeprefix('torch.') for d in CODES)})")
        name = path or "tensor"
        if name in self.names:
            k = 1
            while f"{name}#{k}" in self.names:
                k += 1
            name = f"{name}#{k}"
        self.names.add(name)
        self.entries.append(Entry(name, code, tuple(t.shape), 0, t.numel() * ITEMSIZE[code], t))
        return name

    def encode(self, obj: Any, path: str, depth: int) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"__t": self.tensor(obj, path)}
        if depth >= MAX_DEPTH:
            raise TypeError(f"the state is nested deeper than {MAX_DEPTH} levels at {path}")
        prefix = f"{path}." if path else ""
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if k.__class__ is not str and (not isinstance(k, (str, int)) or isinstance(k, bool)):
                    raise TypeError(f"cannot store a dict key of type {type(k).__name__} at {path or 'the top'}")
                if isinstance(v, torch.Tensor):  # the common case, without a call of encode
                    items.append([k, {"__t": self.tensor(v, f"{prefix}{k}")}])
                else:
                    items.append([k, self.encode(v, f"{prefix}{k}", depth + 1)])
            return {"__d": items}
        if isinstance(obj, (list, tuple)):
            nodes = [self.encode(v, f"{prefix}{i}", depth + 1) for i, v in enumerate(obj)]
            return {"__tuple": nodes} if isinstance(obj, tuple) else nodes
        if isinstance(obj, np.ndarray):
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while a state's many small objects are made (a full collection in the
    middle costs more than the rest of the work)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


# ---- reading ---------------------------------------------------------------------------------------
def json_values(text: bytes) -> int:
    """An upper bound of the number of values a JSON text parses into (its separators and openers)."""
    return text.count(b",") + text.count(b":") + text.count(b"[") + text.count(b"{")


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _tensor_table(header: Dict[str, Any], data_len: int, name: str) -> List[Tuple[str, str, List[int], int, int]]:
    table = []
    for tname, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _error(name, f"tensor {tname[:80]!r}: needs exactly dtype, shape and data_offsets")
        code, shape, span = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise _error(name, f"tensor {tname[:80]!r}: unknown dtype {str(code)[:20]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
            raise _error(name, f"tensor {tname[:80]!r}: shape must be a list of at most {MAX_DIMS} non-negative ints")
        if not isinstance(span, list) or len(span) != 2 or not all(_is_count(x) for x in span) or span[0] > span[1]:
            raise _error(name, f"tensor {tname[:80]!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
        table.append((tname, code, shape, span[0], span[1]))
    table.sort(key=lambda row: (row[3], row[4]))
    expected = 0
    for tname, code, shape, begin, end in table:
        if begin != expected:
            raise _error(name, f"tensor {tname[:80]!r}: data_offsets overlap or leave a gap (begins at {begin}, expected {expected})")
        count = 1
        for d in shape:  # checked: stop as soon as the count cannot fit the data
            count *= d
            if count * ITEMSIZE[code] > data_len:
                raise _error(name, f"tensor {tname[:80]!r}: shape {shape[:8]} needs more bytes than the file holds", "size")
        if count * ITEMSIZE[code] != end - begin:
            raise _error(name, f"tensor {tname[:80]!r}: shape and dtype need {count * ITEMSIZE[code]} bytes, data_offsets span {end - begin}")
        expected = end
    if expected != data_len:
        raise _error(name, f"the tensors cover {expected} bytes of data, the file holds {data_len} (truncated?)", "size")
    return table


def _tensors(buf: Any, start: int, table: List[Tuple[str, str, List[int], int, int]]) -> Dict[str, torch.Tensor]:
    """Each tensor over its own span of `buf` (no copy): a storage of its own, offset 0, so code that
    looks at storages (torch.set_rng_state, torch.save) sees only its bytes."""
    out = {}
    for tname, code, shape, begin, end in table:
        dtype = DTYPES[code]
        if end == begin:
            out[tname] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=start + begin)
        if raw.data_ptr() % ITEMSIZE[code]:  # a file not written by us may leave a span unaligned
            raw = raw.clone()
        out[tname] = raw.view(dtype).reshape(shape)
    return out


def _decode(node: Any, tensors: Dict[str, torch.Tensor], depth: int, name: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if depth >= MAX_DEPTH and not (isinstance(node, dict) and len(node) == 1 and ("__t" in node or "__n" in node)):
        raise _error(name, f"the state is nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1, name) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        ((kind, value),) = node.items()
        if kind in ("__t", "__n") and isinstance(value, str) and value in tensors:
            if kind == "__t":
                return tensors[value]
            try:
                return tensors[value].numpy()
            except (TypeError, RuntimeError) as exc:
                raise _error(name, f"tensor {value[:80]!r} cannot be a numpy array ({exc})") from None
        if kind == "__tuple" and isinstance(value, list):
            return tuple(_decode(v, tensors, depth + 1, name) for v in value)
        if kind == "__d" and isinstance(value, list):
            out: Dict[Any, Any] = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool) and item[0] not in out):
                    raise _error(name, "a dict entry of the state is not a [unique str or int key, value] pair")
                out[item[0]] = _decode(item[1], tensors, depth + 1, name)
            return out
    raise _error(name, f"unknown node in the state's skeleton: {str(node)[:60]}")


def parse(buf: Any, name: str = "<buffer>") -> Any:
    """The state stored in `buf` (bytes-like; tensors share its memory). Raises TensorFileError only."""
    try:
        with gc_paused():
            return _parse(buf, name)
    except TensorFileError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as exc:
        raise _error(name, f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _parse(buf: Any, name: str) -> Any:
    view = memoryview(buf).cast("B")
    if view.readonly:  # tensors must own writable memory
        buf = bytearray(view)
        view = memoryview(buf)
    if view.nbytes < 8:
        raise _error(name, f"{view.nbytes} bytes, shorter than the 8-byte header length", "size")
    hlen = int.from_bytes(view[:8], "little")
    if hlen > MAX_HEADER_BYTES:
        raise _error(name, f"header length {hlen}, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + hlen > view.nbytes:
        raise _error(name, f"header of {hlen} bytes runs past the end of the file (truncated?)", "size")
    raw = bytes(view[8 : 8 + hlen])
    if json_values(raw) > MAX_HEADER_VALUES:
        raise _error(name, f"header has more than the {MAX_HEADER_VALUES} JSON values allowed")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                            parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _error(name, f"header is not UTF-8 JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise _error(name, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _error(name, "__metadata__ must map strings to strings")
    table = _tensor_table(header, view.nbytes - 8 - hlen, name)
    tensors = _tensors(buf, 8 + hlen, table)
    if meta is None or TREE_KEY not in meta:
        return tensors  # a plain safetensors file: name -> tensor
    try:
        skeleton = json.loads(meta[TREE_KEY])
    except (ValueError, RecursionError) as exc:
        raise _error(name, f"{TREE_KEY} is not JSON: {str(exc)[:120]}") from None
    return _decode(skeleton, tensors, 0, name)


def read_verified(path: Path, size: Optional[int] = None, checksum: Optional[str] = None,
                  dir_fd: Optional[int] = None) -> bytearray:
    """The file's bytes; checks its size and checksum against the manifest's when given."""
    try:
        return fileio.read_verified(path, size, checksum, dir_fd)
    except TensorFileError:
        raise
    except fileio.FileCheckError as exc:
        raise TensorFileError(str(exc), exc.reason) from None


def load(path: Path, size: Optional[int] = None, checksum: Optional[str] = None, dir_fd: Optional[int] = None) -> Any:
    """The state in the file at `path`, checked against the manifest's size and checksum when given.
    Raises TensorFileError (bad file) or OSError (could not read it)."""
    return parse(read_verified(path, size, checksum, dir_fd), str(path))
