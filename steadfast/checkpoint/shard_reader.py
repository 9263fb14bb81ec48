"""The sharded format's reader: a checkpoint's rank files read back, each rank's own pieces or whole
tensors, every file's table of pieces checked against the manifest's first (see sharded.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import piecetable as pt
from . import tensorfile
from .shards import Box, fill, is_dtensor, like, overlap, target_box, volume
from .sources import Source
from .storage.base import FileCheckError, Files
from .tensorformat import DTYPES, ITEMSIZE, TensorFileError

OWN_PREFIX = "@rank"  # names of this rank's own tensors (object names start with a letter or digit)
OBJECTS, RANK_STATE = "objects", "own"  # a rank file's tree: the objects' skeletons (rank 0), its own state


def file_name(rank: int) -> str:
    return f"rank{rank:05d}.bin"


@dataclass(frozen=True)
class _Piece:
    file: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]


class Reader:
    """Reads a sharded checkpoint's tensors from a Source, by the tensor table; with `check_files`,
    each file's own table of pieces is compared with it when the file's header is first read."""

    def __init__(self, source: Source, table: Dict[str, Any], check_files: bool = True) -> None:
        self.source = source
        self.table = table
        self.check_files = check_files
        self._by_file: Optional[pt.ByFile] = None
        self._headers: Dict[str, tensorfile.Header] = {}
        self._rows: Dict[str, Dict[str, tensorfile.Row]] = {}  # file -> its tensor table by name

    def header(self, name: str) -> tensorfile.Header:
        header = self._headers.get(name)
        if header is None:
            size = self.source.size(name)
            hlen = tensorfile.header_length(self.source.read(name, 0, min(8, size)), size, name)
            header = tensorfile.parse_header(bytes(self.source.read(name, 8, hlen)), size - 8 - hlen, name)
            if self.check_files:
                self._by_file = self._by_file if self._by_file is not None else pt.by_file(self.table)
                problem = pt.mismatch(name, header.meta, self.table, self._by_file)
                if problem:
                    raise TensorFileError(f"{problem}: the manifest does not describe its files", "contents")
            self._headers[name] = header
        return header

    def tree(self, name: str) -> Dict[str, Any]:
        """The file's skeleton (objects' tensors as ShardRefs) with its own state's tensors read."""
        header = self.header(name)
        skeleton = header.skeleton(name)
        own_rows = [row for row in header.table if row[0].startswith(OWN_PREFIX)]
        tensors: Dict[str, torch.Tensor] = {}
        if own_rows:
            begin, end = own_rows[0][3], own_rows[0][4]
            for row in own_rows:
                begin, end = min(begin, row[3]), max(end, row[4])
            data = self.source.read(name, header.data_start + begin, end - begin)
            shifted = [(n, c, s, b - begin, e - begin) for n, c, s, b, e in own_rows]
            tensors = tensorfile.tensors_over(data, 0, shifted)
        tree = tensorfile.decode(skeleton, tensors, name, refs=True)
        if not isinstance(tree, dict) or RANK_STATE not in tree:
            raise TensorFileError(f"{name}: not a rank file of a sharded checkpoint (no skeleton)", "format")
        return tree

    def _pieces(self, key: str) -> Tuple[str, Tuple[int, ...], List[_Piece]]:
        entry = self.table.get(key)
        if entry is None:
            raise TensorFileError(f"tensor {key[:120]!r} is not in the checkpoint's tensor table", "contents")
        return entry["dtype"], tuple(entry["shape"]), [_Piece(f, tuple(o), tuple(s)) for f, o, s in entry["pieces"]]

    def whole_shape(self, key: str) -> Tuple[int, ...]:
        return self._pieces(key)[1]

    def region(self, key: str, box: Box) -> torch.Tensor:
        """The values of tensor `key` in `box`, read from the pieces that overlap it (only their rows
        in it). A box that is exactly one saved piece (a resume on the same world size) is that
        piece's bytes, not copied."""
        code, whole, pieces = self._pieces(key)
        offset, shape = box
        if len(offset) != len(whole) or any(o < 0 or o + n > w for o, n, w in zip(offset, shape, whole)):
            raise TensorFileError(f"tensor {key[:120]!r}: {box} is outside its shape {list(whole)}", "contents")
        exact = [p for p in pieces if p.offset == tuple(offset) and p.shape == tuple(shape)]
        if exact and volume(shape):
            rows = shape[0] if shape else 1
            return self._rows_of(key, code, exact[0], 0, rows).reshape(shape)
        parts = [(p, overlap(box, (p.offset, p.shape)) if p.shape else box) for p in pieces]
        used: List[List[Any]] = [[p.file, list(part[0]), list(part[1])] for p, part in parts if part and volume(part[1])]
        if pt.overlapping(used) or sum(volume(part[2]) for part in used) != volume(shape):
            raise TensorFileError(
                f"tensor {key[:120]!r}: its pieces do not cover the {volume(shape)} values needed exactly once", "contents"
            )
        out = torch.empty(shape, dtype=DTYPES[code])
        covered = 0
        for piece, part in parts:
            covered += self._fill_from(key, code, piece, out, box) if part is not None else 0
        if covered != volume(shape):
            raise TensorFileError(
                f"tensor {key[:120]!r}: the pieces cover {covered} of the {volume(shape)} values needed", "contents"
            )
        return out

    def _row(self, file: str, key: str) -> tensorfile.Row:
        rows = self._rows.get(file)
        if rows is None:
            rows = self._rows[file] = {row[0]: row for row in self.header(file).table}
        row = rows.get(key)
        if row is None:
            raise TensorFileError(f"{file}: does not hold tensor {key[:120]!r} as the tensor table says", "contents")
        return row

    def _rows_of(self, key: str, code: str, piece: _Piece, first: int, rows: int) -> torch.Tensor:
        """Rows [first, first + rows) of a saved piece (a 0-d piece: its one value), as a flat tensor."""
        _, row_code, shape, begin, _ = row = self._row(piece.file, key)
        if row_code != code or tuple(shape) != piece.shape:
            raise TensorFileError(f"{piece.file}: does not hold tensor {row[0][:120]!r} as the tensor table says", "contents")
        row_bytes = volume(shape[1:]) * ITEMSIZE[code] if shape else ITEMSIZE[code]
        data = self.source.read(piece.file, self.header(piece.file).data_start + begin + first * row_bytes, rows * row_bytes)
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        if raw.data_ptr() % ITEMSIZE[code]:  # a file not written by us may leave a span unaligned
            raw = raw.clone()
        return raw.view(DTYPES[code])

    def _fill_from(self, key: str, code: str, piece: _Piece, out: torch.Tensor, box: Box) -> int:
        common = overlap(box, (piece.offset, piece.shape)) if piece.shape else ((), ())
        if common is None:
            return 0
        if not piece.shape:  # a 0-d tensor
            out.copy_(self._rows_of(key, code, piece, 0, 1).reshape(()))
            return 1
        first, rows = common[0][0] - piece.offset[0], common[1][0]
        part = self._rows_of(key, code, piece, first, rows).reshape((rows, *piece.shape[1:]))
        part_box = ((piece.offset[0] + first, *piece.offset[1:]), (rows, *piece.shape[1:]))
        return fill(out, box, part, part_box)


def _optimizer_params(obj: Any) -> List[Any]:
    if isinstance(obj, torch.optim.Optimizer):
        return [p for group in obj.param_groups for p in group["params"]]
    return []


def assemble(node: Any, template: Any, reader: Reader, path: Tuple[Any, ...], fallback: Callable[[Tuple[Any, ...]], Any]) -> Any:
    """The skeleton `node` with every ShardRef read: a live DTensor at the same place (or what
    `fallback` names for it) gets its own piece, anything else the whole tensor."""
    if isinstance(node, tensorfile.ShardRef):
        whole = reader.whole_shape(node.key)
        like_this = template if template is not None else fallback(path)
        if is_dtensor(like_this) and tuple(int(d) for d in like_this.shape) == whole:
            box = target_box(like_this)
            if box is not None:
                return like(reader.region(node.key, box), like_this)
        return reader.region(node.key, ((0,) * len(whole), whole))
    if isinstance(node, dict):
        get = template.get if isinstance(template, dict) else (lambda _k: None)
        return {k: assemble(v, get(k), reader, (*path, k), fallback) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [
            assemble(
                v,
                template[i] if isinstance(template, (list, tuple)) and i < len(template) else None,
                reader,
                (*path, i),
                fallback,
            )
            for i, v in enumerate(node)
        ]
        return tuple(items) if isinstance(node, tuple) else items
    return node


def load(
    reader: Reader, rank_file: Optional[str], objects: Dict[str, Any], root_file: str = file_name(0)
) -> Tuple[Dict[str, Any], Any]:
    """The states of `objects` (name -> live object) read for this rank, and `rank_file`'s own state
    (this rank's RNG states...; None without a file). Raises TensorFileError (or OSError) when the
    checkpoint cannot give them."""
    root = reader.tree(root_file)
    skeletons = root.get(OBJECTS)
    if not isinstance(skeletons, dict):
        raise TensorFileError(f"{root_file}: holds no objects' skeleton", "format")
    missing = [name for name in objects if name not in skeletons]
    if missing:
        raise TensorFileError(f"the checkpoint holds no {', '.join(missing)}", "missing")
    own = None if rank_file is None else root[RANK_STATE] if rank_file == root_file else reader.tree(rank_file)[RANK_STATE]
    states = {}
    for name, obj in objects.items():
        params = _optimizer_params(obj)

        def by_param(path: Tuple[Any, ...], params: List[Any] = params) -> Any:
            # an optimizer without state yet: its state for parameter i is sharded like parameter i
            if len(path) >= 2 and path[0] == "state" and isinstance(path[1], int) and 0 <= path[1] < len(params):
                return params[path[1]]
            return None

        states[name] = assemble(skeletons[name], obj.state_dict(), reader, (), by_param)
    return states, own


def whole_reader(files: Files, manifest: Dict[str, Any], names: Optional[Sequence[str]]) -> Tuple[Reader, Dict[str, Any]]:
    """A reader of every rank's file (each one's table of pieces checked against the manifest's) and the
    objects' skeletons, holding `names`."""
    reader = Reader(files, manifest["tensors"])
    for file in manifest["files"]:
        reader.header(file)
    skeletons = reader.tree(file_name(0)).get(OBJECTS)
    if not isinstance(skeletons, dict):
        raise TensorFileError(f"{files.where(file_name(0))}: holds no objects' skeleton", "format")
    missing = [n for n in names or [] if n not in skeletons]
    if missing:
        raise FileCheckError(f"{files.where('')}: holds no {', '.join(missing)} (it holds {sorted(skeletons)})", "missing")
    return reader, skeletons
