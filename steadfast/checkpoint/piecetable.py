"""A sharded checkpoint's tables of pieces: the manifest's tensor table, and each rank file's own.

Every rank file records in its metadata (`steadfast.pieces`) every tensor key of the objects with its
dtype code and whole shape, and the pieces the file itself holds: `{"keys": {key: [code, whole]},
"pieces": {key: [code, whole, offset, shape]}}`. The manifest's tensor table is built from them
(`tensor_table`). A reader compares each file's own table with the manifest's (`mismatch`) before it
takes a piece from it: a manifest that names the wrong file for a piece (one flipped bit turns
rank00001.bin into rank00000.bin, and rank 0's rows of the same shape would be read in their
place), or another dtype or shape, is then unusable even where its digest was made to match.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

PIECES_KEY = "steadfast.pieces"  # a rank file's metadata: every key it knows and the pieces it holds
ByFile = Dict[str, Dict[str, List[List[Any]]]]  # file -> key -> [[code, whole, offset, shape], ...]


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
