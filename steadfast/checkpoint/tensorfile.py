"""Reading checkpoint files: nothing is unpickled, so a tampered file can fail to load but cannot run code.

The loader enforces safetensors' rules, and refuses anything else as TensorFileError: a header of at
most MAX_HEADER_BYTES and MAX_HEADER_VALUES, UTF-8 JSON object without duplicate keys, known dtypes
only, shapes of non-negative ints whose non-zero dims multiply to at most MAX_ELEMENT_BYTES bytes (an
empty tensor of shape [0, 2**62, 2**62] would pass the size check and overflow torch's strides),
offsets sorted, contiguous and covering the data exactly, element count times dtype size equal to
each span; and, for the skeleton, a depth of at most MAX_DEPTH and
only the node kinds the writer makes. The format is described in tensorformat; writing is in
tensorwrite (re-exported here: save, plan, export_safetensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .manifest import TENSOR_KEY
from .storage import fileio
from .tensorformat import (
    CHECKSUM,
    DTYPES,
    ITEMSIZE,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_HEADER_VALUES,
    TREE_KEY,
    TensorFileError,
    gc_paused,
    json_values,
)
from .tensorformat import format_error as _error
from .tensorwrite import Layout, export_safetensors, plan, save

__all__ = [
    "CHECKSUM",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_VALUES",
    "TREE_KEY",
    "Layout",
    "TensorFileError",
    "export_safetensors",
    "json_values",
    "load",
    "parse",
    "plan",
    "read_verified",
    "save",
]


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _no_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


MAX_ELEMENT_BYTES = 2**62  # the product of a shape's non-zero dims times the dtype's size: torch's strides fit in int64


def _fits_torch(shape: List[int], itemsize: int) -> bool:
    """The shape's strides fit in int64 whatever its element count (an empty tensor's too)."""
    product = itemsize
    for d in shape:
        product *= max(d, 1)
        if product > MAX_ELEMENT_BYTES:
            return False
    return True


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
        if not _fits_torch(shape, ITEMSIZE[code]):
            raise _error(name, f"tensor {tname[:80]!r}: shape {shape[:8]} is too large for a tensor (even an empty one)")
        if not isinstance(span, list) or len(span) != 2 or not all(_is_count(x) for x in span) or span[0] > span[1]:
            raise _error(name, f"tensor {tname[:80]!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
        table.append((tname, code, shape, span[0], span[1]))
    table.sort(key=lambda row: (row[3], row[4]))
    expected = 0
    for tname, code, shape, begin, end in table:
        if begin != expected:
            raise _error(
                name, f"tensor {tname[:80]!r}: data_offsets overlap or leave a gap (begins at {begin}, expected {expected})"
            )
        count = 1
        for d in shape:  # checked: stop as soon as the count cannot fit the data
            count *= d
            if count * ITEMSIZE[code] > data_len:
                raise _error(name, f"tensor {tname[:80]!r}: shape {shape[:8]} needs more bytes than the file holds", "size")
        if count * ITEMSIZE[code] != end - begin:
            raise _error(
                name,
                f"tensor {tname[:80]!r}: shape and dtype need {count * ITEMSIZE[code]} bytes, data_offsets span {end - begin}",
            )
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


@dataclass(frozen=True)
class ShardRef:
    """The place of a sharded tensor in a state's skeleton: its key in the checkpoint's tensor table."""

    key: str


def decode(skeleton: Any, tensors: Dict[str, torch.Tensor], name: str, refs: bool = False) -> Any:
    """The state a skeleton describes, its tensors from `tensors` (ShardRefs kept with `refs`)."""
    with gc_paused():
        return _decode(skeleton, tensors, 0, name, refs)


def tensors_over(buf: Any, start: int, table: List[Row]) -> Dict[str, torch.Tensor]:
    """The tensors of `table` over `buf`, their data starting at `start` (no copy)."""
    return _tensors(buf, start, table)


def _decode(node: Any, tensors: Dict[str, torch.Tensor], depth: int, name: str, refs: bool = False) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if depth >= MAX_DEPTH and not (
        isinstance(node, dict) and len(node) == 1 and ("__t" in node or "__n" in node or "__s" in node)
    ):
        raise _error(name, f"the state is nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1, name, refs) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        ((kind, value),) = node.items()
        if kind in ("__t", "__n") and isinstance(value, str) and value in tensors:
            if kind == "__t":
                return tensors[value]
            try:
                return tensors[value].numpy()
            except (TypeError, RuntimeError) as exc:
                raise _error(name, f"tensor {value[:80]!r} cannot be a numpy array ({exc})") from None
        if kind == "__s" and refs and isinstance(value, str) and TENSOR_KEY.fullmatch(value):
            return ShardRef(value)
        if kind == "__tuple" and isinstance(value, list):
            return tuple(_decode(v, tensors, depth + 1, name, refs) for v in value)
        if kind == "__d" and isinstance(value, list):
            out: Dict[Any, Any] = {}
            for item in value:
                if not (
                    isinstance(item, list)
                    and len(item) == 2
                    and isinstance(item[0], (str, int))
                    and not isinstance(item[0], bool)
                    and item[0] not in out
                ):
                    raise _error(name, "a dict entry of the state is not a [unique str or int key, value] pair")
                out[item[0]] = _decode(item[1], tensors, depth + 1, name, refs)
            return out
    raise _error(name, f"unknown node in the state's skeleton: {str(node)[:60]}")


def parse(buf: Any, name: str = "<buffer>", refs: bool = False) -> Any:
    """The state stored in `buf` (bytes-like; tensors share its memory). Raises TensorFileError only
    (torch's own refusal to build a tensor, a RuntimeError, included). With `refs`, a sharded
    tensor's place in the skeleton ({"__s": key}) becomes a ShardRef(key)."""
    try:
        with gc_paused():
            return _parse(buf, name, refs)
    except TensorFileError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError, RuntimeError) as exc:
        raise _error(name, f"{type(exc).__name__}: {str(exc)[:200]}") from None


Row = Tuple[str, str, List[int], int, int]  # a tensor's name, dtype code, shape, [begin, end) in the data


@dataclass(frozen=True)
class Header:
    """A tensor file's validated header: its tensor table, metadata and where the data starts."""

    table: List[Row]
    meta: Optional[Dict[str, str]]
    data_start: int  # 8 + the header's length

    def skeleton(self, name: str) -> Any:
        """The state's skeleton from the metadata (None for a plain safetensors file)."""
        if self.meta is None or TREE_KEY not in self.meta:
            return None
        try:
            return json.loads(self.meta[TREE_KEY])
        except (ValueError, RecursionError) as exc:
            raise _error(name, f"{TREE_KEY} is not JSON: {str(exc)[:120]}") from None


def header_length(prefix: Any, file_bytes: int, name: str) -> int:
    """The header's length from the file's first 8 bytes, checked against the bounds and the file's size."""
    if file_bytes < 8 or len(prefix) < 8:
        raise _error(name, f"{file_bytes} bytes, shorter than the 8-byte header length", "size")
    hlen = int.from_bytes(bytes(prefix[:8]), "little")
    if hlen > MAX_HEADER_BYTES:
        raise _error(name, f"header length {hlen}, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + hlen > file_bytes:
        raise _error(name, f"header of {hlen} bytes runs past the end of the file (truncated?)", "size")
    return hlen


def parse_header(raw: bytes, data_len: int, name: str) -> Header:
    """The header `raw` (the JSON after the length prefix) of a file with `data_len` bytes of data."""
    if json_values(raw) > MAX_HEADER_VALUES:
        raise _error(name, f"header has more than the {MAX_HEADER_VALUES} JSON values allowed")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _error(name, f"header is not UTF-8 JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise _error(name, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _error(name, "__metadata__ must map strings to strings")
    return Header(_tensor_table(header, data_len, name), meta, 8 + len(raw))


def _parse(buf: Any, name: str, refs: bool = False) -> Any:
    view = memoryview(buf).cast("B")
    if view.readonly:  # tensors must own writable memory
        buf = bytearray(view)
        view = memoryview(buf)
    hlen = header_length(view[:8], view.nbytes, name)
    header = parse_header(bytes(view[8 : 8 + hlen]), view.nbytes - 8 - hlen, name)
    tensors = _tensors(buf, header.data_start, header.table)
    skeleton = header.skeleton(name)
    if skeleton is None:
        return tensors  # a plain safetensors file: name -> tensor
    return _decode(skeleton, tensors, 0, name, refs)


def read_verified(
    path: Path, size: Optional[int] = None, checksum: Optional[str] = None, dir_fd: Optional[int] = None
) -> bytearray:
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
