"""A checkpoint file format that cannot run code on load: a JSON header plus raw tensor bytes.

    b"STEADFST" | u64 header length | header (JSON) | padding | tensor bytes (each 64-byte aligned)

The header holds the state's structure (dicts with str or int keys, lists, tuples, numbers,
strings, None) with tensors and numpy arrays replaced by references into a table of dtype,
shape, offset and size. Nothing is unpickled, so a tampered file can fail to load but cannot
execute anything. Writes go straight from the tensors' memory to the file (no serialisation
copy). Files are checksummed with xxh3-128: corruption detection at memory speed (sha256 costs
more than the write itself here; tamper safety comes from never unpickling, not from the hash).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import torch
import xxhash

MAGIC = b"STEADFST"
VERSION = 1
ALIGN = 64
DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
}
READ_CHUNK = 64 << 20
CHECKSUM = "xxh3_128"


class TensorFileError(ValueError):
    """The file is not a valid tensor file (truncated, damaged, or not ours)."""


def _encode(obj: Any, tensors: List[torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__t": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {"__n": len(tensors) - 1}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store a dict key of type {type(k).__name__} at {path}")
            items.append([k, _encode(v, tensors, f"{path}.{k}")])
        return {"__d": items}
    if isinstance(obj, tuple):
        return {"__tuple": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store an object of type {type(obj).__name__} at {path} in a checkpoint")


def _decode(node: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if "__t" in node:
            return tensors[node["__t"]]
        if "__n" in node:
            return tensors[node["__n"]].numpy()
        if "__tuple" in node:
            return tuple(_decode(v, tensors) for v in node["__tuple"])
        if "__d" in node:
            return {k: _decode(v, tensors) for k, v in node["__d"]}
        raise TensorFileError(f"unknown node in header: {sorted(node)[:3]}")
    return node


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def save(tree: Any, path: Path) -> Tuple[int, str]:
    """Write `tree` to `path` and fsync it; returns (size in bytes, "xxh3_128:<hex>")."""
    tensors: List[torch.Tensor] = []
    skeleton = _encode(tree, tensors, "state")
    buffers = [_as_bytes(t) for t in tensors]
    table, offset = [], 0
    for t, buf in zip(tensors, buffers):
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"cannot store a tensor of dtype {dtype}")
        table.append({"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": buf.nbytes})
        offset = _align(offset + buf.nbytes)
    header = json.dumps({"version": VERSION, "tree": skeleton, "tensors": table}).encode()
    start = _align(16 + len(header))
    chunks: List[memoryview] = [memoryview(MAGIC + struct.pack("<Q", len(header)) + header + b"\0" * (start - 16 - len(header)))]
    for entry, buf in zip(table, buffers):
        chunks.append(buf)
        padding = _align(buf.nbytes) - buf.nbytes
        if padding:
            chunks.append(memoryview(b"\0" * padding))
    digest = xxhash.xxh3_128()
    with open(path, "wb", buffering=0) as f:
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
        os.fsync(f.fileno())
    return sum(c.nbytes for c in chunks), f"{CHECKSUM}:{digest.hexdigest()}"


def read_verified(path: Path, size: int | None = None, checksum: str | None = None) -> bytearray:
    """The file's bytes; checks its size and checksum against the manifest's when given."""
    actual = os.path.getsize(path)
    if size is not None and actual != size:
        raise TensorFileError(f"{path}: size is {actual} bytes, the manifest says {size}")
    if checksum is not None and not checksum.startswith(f"{CHECKSUM}:"):
        raise TensorFileError(f"{path}: unknown checksum {checksum.split(':')[0]!r} in the manifest (expected {CHECKSUM})")
    buf = bytearray(actual)
    view = memoryview(buf)
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < actual:
            n = f.readinto(view[pos : pos + READ_CHUNK])
            if not n:
                raise TensorFileError(f"{path}: ended after {pos} of {actual} bytes")
            digest.update(view[pos : pos + n])
            pos += n
    if checksum is not None and f"{CHECKSUM}:{digest.hexdigest()}" != checksum:
        raise TensorFileError(f"{path}: checksum mismatch (the file was changed or damaged after it was written)")
    return buf


def parse(buf: bytearray, name: str = "<buffer>") -> Any:
    """The state stored in `buf` (tensors share its memory)."""
    if len(buf) < 16 or bytes(buf[:8]) != MAGIC:
        raise TensorFileError(f"{name}: not a steadfast tensor file (bad magic); refusing to load it")
    (hlen,) = struct.unpack("<Q", bytes(buf[8:16]))
    if 16 + hlen > len(buf):
        raise TensorFileError(f"{name}: header runs past the end of the file (truncated?)")
    try:
        header = json.loads(bytes(buf[16 : 16 + hlen]))
        start = _align(16 + hlen)
        tensors = []
        for e in header["tensors"]:
            dtype = DTYPES[e["dtype"]]
            begin, nbytes = start + int(e["offset"]), int(e["nbytes"])
            count = int(np.prod(e["shape"], dtype=np.int64))
            if begin + nbytes > len(buf) or count * torch.empty((), dtype=dtype).element_size() != nbytes:
                raise TensorFileError(f"{name}: tensor table does not match the file (truncated?)")
            if count == 0:
                tensors.append(torch.empty(e["shape"], dtype=dtype))
            else:
                tensors.append(torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(e["shape"]))
        return _decode(header["tree"], tensors)
    except TensorFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise TensorFileError(f"{name}: malformed header ({type(exc).__name__}: {exc})") from None


def load(path: Path, size: int | None = None, checksum: str | None = None) -> Any:
    return parse(read_verified(path, size, checksum), str(path))
