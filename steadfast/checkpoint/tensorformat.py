"""The checkpoint file format, shared by its writer (tensorwrite) and its reader (tensorfile).

safetensors, with the state's structure in its metadata:

    u64 little-endian N | N bytes of JSON header (space-padded so the data starts 64-byte aligned) | data

The header is safetensors' own: per tensor `dtype` (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL,
U64, U32, U16, C64, F8_*), `shape` and `data_offsets` [begin, end) relative to the data, which the
tensors cover exactly, in order, without gaps; `__metadata__` is a string->string map. Ours holds
`steadfast.tree`: the state's skeleton as JSON (dicts with str or int keys, lists, tuples, numbers,
strings, None; tensors and numpy arrays as references to their names). Any safetensors reader
opens a checkpoint file: `safetensors.safe_open(path, "pt")` lists its tensors by the dotted path
of their place in the state (`net.0.weight`, `state.0.exp_avg`). Tensors are ordered by element
size (largest first), so each is aligned.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Dict, Iterator

import torch

from .dtypes import TORCH_NAMES
from .storage import fileio

DTYPES: Dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in TORCH_NAMES.items() if hasattr(torch, name)}
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


def format_error(name: str, what: str, reason: str = "format") -> TensorFileError:
    return TensorFileError(f"{name}: not a steadfast tensor file ({what}); refusing to load it", reason)


def json_values(text: bytes) -> int:
    """An upper bound of the number of values a JSON text parses into (its separators and openers)."""
    return text.count(b",") + text.count(b":") + text.count(b"[") + text.count(b"{")


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
