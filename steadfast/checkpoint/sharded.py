"""The sharded format: every rank writes its own file, with its own pieces of the sharded tensors.

For a state that holds DTensors (FSDP2's parameters and optimizer state), a checkpoint is one
file per rank, `rank<r>.bin`, in the tensor file format (safetensors plus the skeleton):
- every rank's file holds the pieces of the sharded tensors that this rank stores (a replicated
  piece is stored once, by coordinate 0 of the mesh dimensions it is replicated over) and this
  rank's own state (its RNG states, the run's per-rank objects);
- rank 0's file also holds the skeleton of every object's state and the tensors that are not
  sharded (a step counter, the loop's progress).
Every tensor of the objects (sharded or not) is a key in the manifest's tensor table, which says
its dtype, its whole shape and where each piece lies: `[file, offset, shape]`. No rank gathers
another rank's pieces to save; each writes its file in parallel with the others.

Loading fills the tensors that the live objects hold on this rank: a live DTensor gets exactly its
own piece (from whichever saved pieces overlap it, on any number of ranks: each rank reads only the
rows it needs of each file), anything else the whole tensor. A file's own table of its pieces is
compared with the manifest's before anything is read from it (piecetable.py), and a tensor is only
returned when its pieces cover every value of it exactly once. A snapshot in memory is the same file
with the replicated part included on every rank (`replicated=True`): each rank restores from its
own file alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import piecetable as pt
from . import tensorfile
from .codec import OWN, Codec, Collectives, LazyTensor, Loaded, Planned, Unsaveable, Whole, flat, register
from .shard_reader import OBJECTS, OWN_PREFIX, RANK_STATE, Reader, assemble, file_name, load, whole_reader
from .shards import is_dtensor, piece_of, volume
from .sources import BufferSource
from .storage.base import Files
from .tensorformat import CODES, TensorFileError, gc_paused
from .tensorwrite import Layout, _place, _Planner

OBJECT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,95}")  # no '.': a tensor's key is "<object>.<path>"


_NOT_SHARDED = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)})


def holds_sharded(tree: Any) -> bool:
    """Whether a state holds a DTensor anywhere (asked of every save's state: one pass, no recursion)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if node.__class__ in _NOT_SHARDED:
            continue
        children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else None
        if children is not None:
            if not set(map(type, children)) <= _NOT_SHARDED:  # a module's state: its classes in one C-level pass
                stack.extend(children)
        elif is_dtensor(node):
            return True
    return False


# ---- writing ------------------------------------------------------------------------------------
class _ShardPlanner(_Planner):
    """Plans one rank's file: its pieces of the objects' sharded tensors (and, when `replicated`,
    every other tensor of the objects), then its own state's tensors."""

    def __init__(self, replicated: bool) -> None:
        super().__init__()
        self.replicated = replicated
        self.own = False
        self.pieces: Dict[str, List[Any]] = {}  # key -> [dtype code, whole shape, offset, shape] of what this file holds
        self.keys: Dict[str, List[Any]] = {}  # key -> [dtype code, whole shape] of every tensor of the objects

    def leaf(self, t: torch.Tensor, path: str) -> Any:
        if self.own:
            return super().leaf(t, path)
        if path in self.keys:  # the key must name one tensor on every rank (e.g. dict keys "a.b" and a -> b)
            raise TypeError(f"two tensors of the state have the same key {path!r}; rename one")
        if is_dtensor(t):
            piece = piece_of(t, path)
            code = self._code(t, path)
            self.keys[path] = [code, list(piece.whole)]
            if piece.writer and volume(piece.shape):
                self.tensor(piece.local, path)
                self.pieces[path] = [code, list(piece.whole), list(piece.offset), list(piece.shape)]
        else:
            code = self._code(t, path)
            self.keys[path] = [code, list(t.shape)]
            if self.replicated and t.numel():
                self.tensor(t, path)
                self.pieces[path] = [code, list(t.shape), [0] * t.dim(), list(t.shape)]
        return {"__s": path}

    @staticmethod
    def _code(t: torch.Tensor, path: str) -> str:
        code = CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"cannot store a tensor of dtype {t.dtype} at {path}")
        return code


@dataclass
class RankFile:
    """What one rank writes: its file's layout, and what the manifest needs to know of it."""

    layout: Layout
    pieces: Dict[str, List[Any]]  # what the file holds
    keys: Dict[str, List[Any]]  # every tensor of the objects: [dtype code, whole shape]


def plan(objects: Dict[str, Any], own: Dict[str, Any], skeleton: bool, replicated: bool) -> RankFile:
    """This rank's file: `objects` (name -> state; their pieces this rank stores, and with `replicated`
    every other tensor of theirs too), the objects' skeleton when `skeleton`, and `own` (this rank's state)."""
    planner = _ShardPlanner(replicated)
    tree: Dict[str, Any] = {}
    with gc_paused():
        encoded = {}
        for name, state in objects.items():
            encoded[name] = planner.encode(state, name, 1)
        if skeleton:
            tree[OBJECTS] = {"__d": [[name, node] for name, node in encoded.items()]}
        planner.own = True
        tree[RANK_STATE] = planner.encode(own, OWN_PREFIX, 1)
    layout = Layout({"__d": [[k, v] for k, v in tree.items()]}, planner.entries, _place(planner.entries))
    layout.metadata = pt.metadata(planner.keys, planner.pieces)
    return RankFile(layout, planner.pieces, planner.keys)


def _planned(
    objects: Dict[str, Any], own: Dict[str, Any], skeleton: bool, replicated: bool
) -> Tuple[Layout, Tuple[Dict[str, List[Any]], Dict[str, List[Any]]]]:
    rank_file = plan(objects, own, skeleton, replicated)
    return rank_file.layout, (rank_file.pieces, rank_file.keys)


# ---- reading ------------------------------------------------------------------------------------
@register
class ShardedCodec(Codec):
    spec = pt.SHARDED
    every_rank_writes = True

    def wants(self, objects: Dict[str, Any]) -> bool:
        return any(holds_sharded(state) for state in objects.values())

    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        bad = [name for name in objects if not OBJECT_NAME.fullmatch(name)]
        if bad:
            raise Unsaveable(f"objects named {bad}", "in a sharded checkpoint, names are letters, digits, '_' and '-'")
        first = comm.rank == 0
        name = file_name(comm.rank)
        try:
            tree = {OBJECTS: objects, RANK_STATE: own} if first else {RANK_STATE: own}  # what plan's skeleton is
            layout, (pieces, keys) = self.layout(name, (objects, own), tree, lambda: _planned(objects, own, first, first))
        except (TypeError, ValueError) as exc:
            raise Unsaveable("the state", str(exc)) from exc
        return Planned({name: layout}, {"pieces": {name: pieces}, "keys": keys if first else {}})

    def manifest_fields(self, reports: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"tensors": pt.tensor_table([(f, pieces, r["keys"]) for r in reports for f, pieces in r["pieces"].items()])}

    def load(
        self, files: Files, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int, world_size: int
    ) -> Loaded:
        table, saved = manifest["files"], manifest["world_size"]
        mine = file_name(rank) if rank < saved else None
        reader = Reader(files, manifest["tensors"])
        # every file verified whole, and its table of pieces checked, by one rank each
        for i, name in enumerate(sorted(table)):
            if i % world_size != rank:
                continue
            if name == mine:  # its own file: read once, verified, and the pieces taken from memory
                files.hold(name, files.read_verified(name, table[name]["bytes"], table[name]["checksum"]))
            else:
                files.verify(name, table[name]["bytes"], table[name]["checksum"])
            reader.header(name)
        states, own_state = load(reader, mine, objects)
        if own_state is not None and not (isinstance(own_state, dict) and all(n in own_state for n in own)):
            raise TensorFileError(f"{files.where(file_name(rank))}: does not hold this rank's {own}", "contents")
        return Loaded(states, own_state, saved)

    def read_whole(self, files: Files, manifest: Dict[str, Any], names: Optional[Sequence[str]] = None) -> Whole:
        reader, skeletons = whole_reader(files, manifest, names)
        wanted = list(skeletons) if names is None else list(names)
        objects = {n: assemble(skeletons[n], None, reader, (), lambda _path: None) for n in wanted}
        return Whole(objects, [reader.tree(file_name(r))[RANK_STATE] for r in range(int(manifest["world_size"]))])

    def tensors(self, files: Files, manifest: Dict[str, Any], name: str) -> Optional[Dict[str, LazyTensor]]:
        reader, skeletons = whole_reader(files, manifest, [name])
        state, table = skeletons[name], manifest["tensors"]
        if not flat(state):
            return None

        def read(key: str) -> torch.Tensor:
            whole = tuple(table[key]["shape"])
            return reader.region(key, ((0,) * len(whole), whole))

        refs = {k: v.key for k, v in state.items() if isinstance(v, tensorfile.ShardRef)}
        return {k: LazyTensor(table[key]["dtype"], tuple(table[key]["shape"]), partial(read, key)) for k, key in refs.items()}

    def snapshot(self, objects: Dict[str, Any], own: Dict[str, Any], writes_objects: bool) -> Dict[str, Layout]:
        tree = {OBJECTS: objects, RANK_STATE: own}
        return {OWN: self.layout(OWN, (objects, own), tree, lambda: _planned(objects, own, True, True))[0]}

    def snapshot_blobs(self) -> List[str]:
        return [OWN]

    def load_snapshot(self, blobs: Dict[str, Any], objects: Dict[str, Any], rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        source = BufferSource({OWN: blobs[OWN]})
        reader = Reader(source, {}, check_files=False)  # the table is the file's own
        try:
            table = pt.of_snapshot(reader.header(OWN).meta, OWN)
        except ValueError as exc:
            raise TensorFileError(str(exc), "format") from None
        problem = pt.tensor_table_problem(table, {OWN: {}}, covering=False)
        if problem:
            raise TensorFileError(f"the snapshot's table of pieces: {problem}", "contents")
        reader.table = table
        states, own_state = load(reader, OWN, objects, root_file=OWN)
        return states, own_state
