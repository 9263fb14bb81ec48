"""A file's layout planned once and reused while the state keeps its structure.

Planning a file (tensorwrite's planner: every tensor's name, the skeleton, each tensor's place) costs
a few microseconds a tensor, on the training thread, at every save and snapshot: tens of
milliseconds for a model of thousands of small tensors, most of an asynchronous save's blocking
part. Between two saves of a training loop the state's structure rarely changes: the same keys, the
same tensors (mostly the very same objects) with the same dtypes and shapes, the same sharding.

`Plans` keeps the last layout planned for each file with the structure of the state it was planned
from: the walk `structure` makes of the state, in the planner's order, of every container (its
kind, its keys and their types, its length), every other value (its type; the values are compared
apart, a float by its bits, so 0.0 and -0.0 differ) and every tensor (its class, dtype, shape and layout; a DTensor's
placements and mesh too). The walk costs a fraction of a plan: a dict of plain tensors (a module's
state) is read in a few C-level passes. When the structure is equal to the last one, the layout is
reused as it was (names, places, the header's tensor table) with each entry's tensor taken from the
new state (the same object, most of the time), and the skeleton refilled with the new values where
a value changed (a step count, an RNG's state, a learning rate); any other difference, or a tensor
that cannot be rebound, and the file is planned from scratch. Strides and devices are not part of
a layout: the copy and the write read them from the tensor each time.

An asynchronous save's plan (`Plans.owned` set) does not read the dtypes and shapes of the tensors
only an optimizer's step changes (staging.Owned, by identity) while the loop is blocked: reading
them, cold after a step, was most of the walk. Their layout is checked by `Layout.recheck` in the
background, before they are copied (the optimizer's next step waits for that copy, so they are still
the tensors of the save); a difference there places the file anew from its tensors as they are (the
structure is otherwise the same) and the next save plans anew.
"""

from __future__ import annotations

import operator
from functools import partial
from itertools import compress
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

import numpy as np
import torch

from .shards import is_dtensor
from .tensorformat import CODES, gc_paused
from .tensorwrite import Entry, Layout, _place

T = TypeVar("T")

_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_SCALARS = frozenset({int, float, bool, str, type(None)})
SMALL = 64  # a file of fewer tensors is planned anew each time: its plan costs about what the walk does
_META = operator.attrgetter("dtype", "shape", "layout")  # one pass: a tensor's fields are read together
_LATER = "later"  # the mark of tensors whose dtype and shape are checked later (optimizer-owned)
_STRIDED = torch.strided


def _scalar(v: Any) -> Any:
    return v.hex() if v.__class__ is float else v


class _Walk:
    """The structure of a state (`marks`), its scalars (`values`; both comparable with ==) and its
    tensors in the planner's order (`leaves`)."""

    def __init__(self, owned: Optional[Set[int]] = None) -> None:
        self.leaves: List[Any] = []
        self.marks: List[Any] = []
        self.values: List[Any] = []
        self.owned = owned  # ids of the tensors whose dtype and shape are checked later
        self.later: List[int] = []  # the leaves whose are

    def walk(self, obj: Any) -> bool:
        """False: a value the walk does not know (the planner refuses it, or is the judge)."""
        cls = obj.__class__
        marks = self.marks
        if isinstance(obj, torch.Tensor):
            self.leaves.append(obj)
            if cls in _PLAIN_TENSORS or not is_dtensor(obj):
                marks.append((cls, obj.dtype, obj.shape, obj.layout))
            else:
                marks.append((cls, obj.dtype, obj.shape, tuple(obj.placements), obj.device_mesh))  # type: ignore[attr-defined]
            return True
        if isinstance(obj, dict):
            keys = tuple(obj)
            marks.append((dict, keys, tuple(map(type, keys))))
            values = list(obj.values())
            types = tuple(map(type, values))
            if set(types) <= _PLAIN_TENSORS:  # a module's state: a few C-level passes
                owned = self.owned
                if owned is not None and all(map(owned.__contains__, map(id, values))):
                    self.later.extend(range(len(self.leaves), len(self.leaves) + len(values)))
                    self.leaves.extend(values)
                    marks.append((types, _LATER))
                    return True
                self.leaves.extend(values)
                marks.append((types, tuple(map(_META, values))))
                return True
            return all(map(self.walk, values))
        if isinstance(obj, (list, tuple)):
            types = tuple(map(type, obj))
            if set(types) <= _SCALARS:  # stored as they are (python's RNG state: 625 ints)
                marks.append((cls, types))
                self.values.append(tuple(map(_scalar, obj)) if float in types else tuple(obj))
                return True
            marks.append((cls, len(obj)))
            return all(map(self.walk, obj))
        if isinstance(obj, np.ndarray):
            self.leaves.append(obj)
            marks.append((cls, obj.dtype, obj.shape))
            return True
        if isinstance(obj, np.generic):
            item = obj.item()
            marks.append((cls, type(item)))
            self.values.append(_scalar(item))
            return True
        if obj is None or isinstance(obj, (bool, int, float, str)):
            marks.append(cls)
            self.values.append(_scalar(obj))
            return True
        return False


def _refill(node: Any, obj: Any) -> Any:
    """The skeleton of `obj`, whose structure is that of the skeleton `node`: its values taken from
    `obj`, its tensors' references (and every subtree without values, a module's state) from `node`."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return node
    if isinstance(obj, dict):
        values = obj.values()
        if set(map(type, values)) <= _PLAIN_TENSORS:
            return node
        return {"__d": [[k, _refill(sub, v)] for (k, sub), v in zip(node["__d"], values)]}
    if isinstance(obj, (list, tuple)):
        nodes = node["__tuple"] if isinstance(obj, tuple) else node
        if set(map(type, obj)) <= _SCALARS:
            nodes = list(obj)
        else:
            nodes = [_refill(sub, v) for sub, v in zip(nodes, obj)]
        return {"__tuple": nodes} if isinstance(obj, tuple) else nodes
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def structure(roots: Sequence[Any], owned: Optional[Set[int]] = None) -> Optional[_Walk]:
    """The walk of `roots` (what one file is planned from, in the planner's order), or None; the
    dtypes and shapes of a dict's tensors that are all in `owned` (ids) are not read."""
    walk = _Walk(owned)
    return walk if all(map(walk.walk, roots)) else None


def _tensor_for(leaf: Any, entry: Entry) -> Optional[torch.Tensor]:
    """The tensor `entry` stores, taken from its leaf in the new state (None: it cannot be, plan anew)."""
    if isinstance(leaf, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(leaf))
    elif leaf.__class__ in _PLAIN_TENSORS or not is_dtensor(leaf):
        return leaf  # type: ignore[no-any-return]
    else:
        t = leaf.to_local()  # this rank's piece: its place, checked against the plan's below
    return t if t.shape == entry.shape and t.nbytes == entry.end - entry.begin else None


class _Plan:
    def __init__(self, walk: _Walk, layout: Layout, extra: Any) -> None:
        self.marks, self.values, self.leaves, self.layout, self.extra = walk.marks, walk.values, walk.leaves, layout, extra
        self.stale = False  # a background check found a tensor's dtype or shape changed: plan anew
        self.at: Dict[int, List[int]] = {}  # leaf -> the positions of its entries
        for k, e in enumerate(layout.entries):
            self.at.setdefault(e.leaf, []).append(k)
        # leaves whose entries hold a tensor made from them (a numpy array's, a DTensor's piece): rebound every time
        self.derived = [
            i
            for i, leaf in enumerate(walk.leaves)
            if isinstance(leaf, np.ndarray) or (leaf.__class__ not in _PLAIN_TENSORS and is_dtensor(leaf))
        ]

    def rebound(self, walk: _Walk, tree: Any) -> Optional[Layout]:
        """The layout with each entry's tensor from the walk's leaves and, when a value changed, the
        skeleton of `tree` (None: a tensor cannot be rebound: plan anew)."""
        old, leaves = self.layout, walk.leaves
        changed = set(compress(range(len(leaves)), map(operator.is_not, leaves, self.leaves)))
        entries = old.entries  # read only from here on: shared with the last save's layout
        if changed or self.derived:
            entries = list(entries)
            with torch.no_grad():  # a DTensor's piece without autograd's bookkeeping
                for i in changed.union(self.derived):
                    for k in self.at.get(i, ()):
                        e = entries[k]
                        t = _tensor_for(leaves[i], e)
                        if t is None:
                            return None
                        entries[k] = Entry(e.name, e.code, e.shape, e.begin, e.end, t, i)
        header, table = old.built()
        skeleton = old.skeleton
        if walk.values != self.values:
            skeleton, header = _refill(old.skeleton, tree), None
        return Layout(skeleton, entries, old.data_bytes, old.metadata, header, _table=table)

    def recheck(self, layout: Layout, later: List[int]) -> Layout:
        """(background) `layout`, when the tensors of the leaves `later` still have its dtypes and shapes
        (and are strided); else the file placed anew from every entry's tensor as it is, this plan stale."""
        entries, at = layout.entries, self.at
        for i in later:
            for k in at.get(i, ()):
                e = entries[k]
                t = e.tensor
                if t.layout is not _STRIDED or t.shape != e.shape or CODES.get(t.dtype) != e.code:
                    self.stale = True
                    return placed_anew(layout)
        return layout


def placed_anew(layout: Layout) -> Layout:
    """The layout of the same skeleton and tensors, each entry's dtype, shape and place from its tensor
    as it is now, in the planner's order (what planning the file anew gives)."""
    entries = []
    for e in sorted(layout.entries, key=operator.attrgetter("leaf")):
        t = e.tensor
        code = CODES.get(t.dtype)
        if code is None or t.layout is not _STRIDED:
            raise TypeError(f"cannot store a tensor of dtype {t.dtype} and layout {t.layout} at {e.name}")
        entries.append(Entry(e.name, code, t.shape, 0, t.nbytes, t, e.leaf))
    return Layout(layout.skeleton, entries, _place(entries), layout.metadata)


class Plans:
    """The last layout of each file (by name) and the structure it was planned from; `reused`
    counts the layouts reused instead of planned (what a test or a benchmark reads). A file of fewer
    than `small` tensors is planned anew each time, without a walk."""

    def __init__(self, small: int = SMALL) -> None:
        self._last: Dict[str, Optional[_Plan]] = {}
        self.reused, self.small = 0, small
        # set for an asynchronous save's plan: the ids of the tensors only an optimizer's step changes,
        # copied in the background before its next step (staging.Owned): their layout checked there too
        self.owned: Optional[Set[int]] = None

    def layout(self, name: str, roots: Sequence[Any], tree: Any, make: Callable[[], Tuple[Layout, T]]) -> Tuple[Layout, T]:
        """File `name`'s layout (and what `make` returns with it) for a state planned by `make` from
        `roots`, in the planner's order, whose skeleton is that of `tree`: the last one's, rebound,
        when the structure is the same; else `make()`'s, kept for next time."""
        last = self._last.get(name)
        if last is None:  # a first plan, or a small state: planned, and walked only when it is not small
            layout, extra = make()
            walked = structure(roots, self.owned) if len(layout.entries) >= self.small else None
            self._remember(name, walked, layout, extra)
            return layout, extra
        # no collection while the walk is made: its marks (a tuple or two a tensor) are dropped once
        # compared, and a collection in the middle would promote them, bringing the next full one nearer
        with gc_paused():
            walk = structure(roots, self.owned)
            if walk is not None and walk.marks == last.marks and not last.stale:
                reused = last.rebound(walk, tree)
                if reused is not None:
                    if walk.later:
                        reused.recheck = partial(last.recheck, reused, walk.later)
                    last.leaves, last.values, last.layout = walk.leaves, walk.values, reused
                    self.reused += 1
                    return reused, last.extra
        self._last.pop(name, None)
        layout, extra = make()
        self._remember(name, walk, layout, extra)
        return layout, extra

    def _remember(self, name: str, walk: Optional[_Walk], layout: Layout, extra: Any) -> None:
        if len(layout.entries) < self.small:
            self._last[name] = None  # planned anew each time, without a walk
        elif walk is not None:
            self._last[name] = _Plan(walk, layout, extra)
