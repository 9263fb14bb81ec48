"""The sharded format's manifest side (no torch): its FormatSpec (format 3, its own field the tensor
table, checked to cover every tensor exactly: `tensor_table_problem`), and its tables of pieces: the
manifest's tensor table, and each rank file's own.

Every rank file records in its metadata (`steadfast.pieces`) every tensor key of the objects with its
dtype code and whole shape, and the pieces the file itself holds: `{"keys": {key: [code, whole]},
"pieces": {key: [code, whole, offset, shape]}}`. The manifest's tensor table is built from them
(`tensor_table`). A reader compares each file's own table with the manifest's (`mismatch`) before it
takes a piece from it: a manifest that names the wrong file for a piece (one flipped bit turns
rank00001.bin into rank00000.bin, and rank 0's rows of the same shape would be read in their
place), or another dtype or shape, is then unusable even where its digest was made to match.
"""

from __future__ import annotations

import heapq
import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import TORCH_NAMES
from .formatspec import TENSOR_KEY, FormatSpec, integer, register

PIECES_KEY = "steadfast.pieces"  # a rank file's metadata: every key it knows and the pieces it holds
ByFile = Dict[str, Dict[str, List[List[Any]]]]  # file -> key -> [[code, whole, offset, shape], ...]
MAX_TENSORS = 1 << 20
MAX_DIMS = 64
MAX_DIM = 1 << 62


def metadata(keys: Dict[str, List[Any]], pieces: Dict[str, List[Any]]) -> Dict[str, str]:
    """A rank file's metadata entry for its table of pieces."""
    return {PIECES_KEY: json.dumps({"keys": keys, "pieces": pieces}, separators=(",", ":"))}


def tensor_table(reports: Sequence[Tuple[str, Dict[str, List[Any]], Dict[str, List[Any]]]]) -> Dict[str, Any]:
    """The manifest's tensor table from every rank's (file, pieces, keys)."""
    table: Dict[str, Dict[str, Any]] = {}
    for _, _, keys in reports:
        for key, (code, whole) in keys.items():
            table.setdefault(key, {"dtype": code, "shape": whole, "pieces": []})
    for file, pieces, _ in reports:
        for key, (code, whole, offset, shape) in pieces.items():
            entry = table.setdefault(key, {"dtype": code, "shape": whole, "pieces": []})
            entry["pieces"].append([file, offset, shape])
    return table


def own_table(meta: Optional[Dict[str, str]], name: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(keys, pieces) of a rank file's own table; ValueError when it has none or it is malformed."""
    try:
        own = json.loads((meta or {})[PIECES_KEY])
        keys, pieces = own["keys"], own["pieces"]
    except (KeyError, TypeError, ValueError, RecursionError):
        raise ValueError(f"{name}: no readable table of its pieces ({PIECES_KEY})") from None
    if not isinstance(keys, dict) or not isinstance(pieces, dict):
        raise ValueError(f"{name}: its table of pieces ({PIECES_KEY}) is not two JSON objects")
    return keys, pieces


def of_snapshot(meta: Optional[Dict[str, str]], name: str) -> Dict[str, Any]:
    """The tensor table of a snapshot, one file holding its own pieces (not yet validated)."""
    keys, pieces = own_table(meta, name)
    try:
        table = {k: {"dtype": c, "shape": w, "pieces": []} for k, (c, w) in keys.items()}
        for k, (_, _, offset, shape) in pieces.items():
            table[k]["pieces"].append([name, offset, shape])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"the snapshot's table of pieces is unreadable ({exc})") from None
    return table


def by_file(table: Dict[str, Any]) -> ByFile:
    """The manifest's (validated) tensor table, by file: what it says each file holds."""
    out: ByFile = {}
    for key, entry in table.items():
        for file, offset, shape in entry["pieces"]:
            out.setdefault(file, {}).setdefault(key, []).append([entry["dtype"], entry["shape"], offset, shape])
    return out


def mismatch(name: str, meta: Optional[Dict[str, str]], table: Dict[str, Any], listed: ByFile) -> Optional[str]:
    """Why rank file `name`'s own table of pieces (its metadata `meta`) disagrees with the manifest's
    tensor `table` (`listed`: by_file of it); None when they agree exactly."""
    try:
        keys, pieces = own_table(meta, name)
    except ValueError as exc:
        return str(exc)
    if len(keys) != len(table):
        return f"{name}: knows {len(keys)} tensors, the manifest's tensor table {len(table)}"
    for key, entry in table.items():
        if keys.get(key) != [entry["dtype"], entry["shape"]]:
            return f"{name}: tensor {key[:120]!r} is {keys.get(key)} in it, {[entry['dtype'], entry['shape']]} in the manifest"
    here = listed.get(name, {})
    for key in sorted(set(here) | set(pieces)):
        if here.get(key, []) != ([pieces[key]] if key in pieces else []):
            return (
                f"{name}: tensor {key[:120]!r}: the manifest says it holds {here.get(key, [])[:4]}, "
                f"the file says {pieces.get(key)} ([dtype, whole shape, offset, shape])"
            )
    return None


# ---- the manifest's tensor table, checked ----------------------------------------------------------
def _dims(value: Any, count: Optional[int] = None) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_DIMS
        and (count is None or len(value) == count)
        and all(integer(d, 0, MAX_DIM) for d in value)
    )


def tensor_table_problem(table: Any, files: Dict[str, Any], covering: bool = True) -> Optional[str]:
    """Why a sharded checkpoint's tensor table is unusable (None: it is usable). Each tensor: a known
    dtype, a shape, and pieces [file, offset, shape] inside it, in files of the manifest, covering it
    exactly (their sizes add up to it, and no two overlap: checked at any number of pieces, see overlapping).
    Without `covering` (one rank's snapshot: its own pieces only) the pieces may cover part of it."""
    if not isinstance(table, dict) or len(table) > MAX_TENSORS:
        return f"must be a JSON object of at most {MAX_TENSORS} tensors"
    for key, entry in table.items():
        what = f"tensor {key[:80]!r}"
        if not TENSOR_KEY.fullmatch(key):
            return f"{what}: not a plain key"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "pieces"}:
            return f"{what}: needs exactly dtype, shape and pieces"
        whole, pieces = entry["shape"], entry["pieces"]
        if (
            not isinstance(entry["dtype"], str)
            or entry["dtype"] not in TORCH_NAMES
            or not _dims(whole)
            or not isinstance(pieces, list)
        ):
            return f"{what}: needs a known dtype, a shape of non-negative ints and a list of pieces"
        total = 0
        for piece in pieces:
            if not (
                isinstance(piece, list)
                and len(piece) == 3
                and isinstance(piece[0], str)
                and piece[0] in files
                and _dims(piece[1], len(whole))
                and _dims(piece[2], len(whole))
            ):
                return f"{what}: a piece must be [a file of the manifest, offset, shape] of its rank"
            if any(o + n > w for o, n, w in zip(piece[1], piece[2], whole)):
                return f"{what}: a piece lies outside its shape"
            total += math.prod(piece[2])
        if total != math.prod(whole) and (covering or total > math.prod(whole)):
            return f"{what}: its pieces hold {total} of its {math.prod(whole)} values"
        if overlapping(pieces):
            return f"{what}: two pieces overlap"
    return None


def overlapping(pieces: List[List[Any]]) -> bool:
    """Whether two non-empty pieces overlap: a sweep along the first dimension, each piece compared
    only with those still open there (O(n log n) for pieces split along one dimension, as every
    saved layout is; no cap on the count). With their sizes adding up to the whole, no overlap means
    every value is covered exactly once."""
    boxes = sorted((p for p in pieces if math.prod(p[2])), key=lambda p: p[1][0] if p[1] else 0)
    if boxes and not boxes[0][1]:
        return len(boxes) > 1  # 0-d pieces: each is the one value
    open_: List[Tuple[int, int]] = []  # (end along the first dimension, index in boxes)
    for i, box in enumerate(boxes):
        while open_ and open_[0][0] <= box[1][0]:
            heapq.heappop(open_)
        if any(_overlap(boxes[j], box) for _, j in open_):
            return True
        heapq.heappush(open_, (box[1][0] + box[2][0], i))
    return False


def _overlap(a: List[Any], b: List[Any]) -> bool:
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a[1], a[2], b[1], b[2])) and bool(
        math.prod(a[2]) and math.prod(b[2])
    )


def _fields(manifest: Dict[str, Any]) -> Optional[str]:
    problem = tensor_table_problem(manifest.get("tensors"), manifest["files"])
    return f"'tensors': {problem}" if problem else None


# one file per rank, and the tensor table (sharded.py)
SHARDED = register(FormatSpec(3, "sharded", _fields))
