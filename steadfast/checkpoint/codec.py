"""The extension point of the checkpoint format: a Codec says what each rank writes for a save and how
each rank gets its state back. The manager (commit protocol, fall-back, retention) and the memory tier
(snapshots) never look inside a file; they ask the codec of the state or of the manifest. Where the
files are is the store's (storage/): a codec reads them through the Files it is handed.

Two codecs write: `replicated` (format 4: every object's state the same on every rank, written once
by rank 0 into one file with every rank's own state, gathered) and `sharded` (format 3: DTensors, each
rank writes its own file); a third reads format 2 (the replicated format's file per object). A new
format is a Codec subclass in its own module ending in `@register`: its FormatSpec (formatspec.py: the
manifest's `format` number, and the check of the manifest fields that are its own) is registered with
it. formats.py imports the built-in ones and says which codec a state or a manifest asks for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple, Type, TypeVar

import torch

from . import formatspec, tensorfile
from .formatspec import FormatSpec
from .reuse import Plans
from .storage.base import Files
from .tensorformat import CODES
from .tensorwrite import Layout

T = TypeVar("T")
SHARED, OWN = "objects", "own"  # a snapshot's buffers: the node's copy of what every rank shares, each rank's own


class Collectives(Protocol):
    """What the checkpoint code needs of the ranks' collectives (steadfast.distributed.comm.Comm provides it)."""

    rank: int
    world_size: int

    def gather_object(self, obj: Any) -> Optional[List[Any]]: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def max_each(self, values: Sequence[float]) -> List[float]: ...


def state_of(obj: Any) -> Any:
    """What a save or a snapshot stores of a Stateful: its state_dict(); a module's with its parameters
    and buffers themselves (keep_vars=True, hooks and overrides honoured as ever): what is stored is
    their bytes, and a detached view of each costs about a microsecond, most of the call for a module of
    many small tensors. A module whose class defines its own state_dict() is asked as a Stateful is."""
    if isinstance(obj, torch.nn.Module) and type(obj).state_dict is torch.nn.Module.state_dict:
        return obj.state_dict(keep_vars=True)
    return obj.state_dict()


def flat(state: Any) -> bool:
    """Whether a state is a flat name -> value dict (a model's state_dict), what a tensor export takes."""
    return isinstance(state, dict) and all(isinstance(k, str) for k in state)


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


class Unsaveable(ValueError):
    """An object's state cannot be stored (its name, and why)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name, self.reason = name, reason


@dataclass
class Planned:
    """One rank's part of a save: the files it writes (name -> layout) and what the manifest needs from it."""

    files: Dict[str, Layout]
    report: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Loaded:
    """One rank's state read back from a checkpoint (or a snapshot)."""

    objects: Dict[str, Any]  # name -> state, for each tracked object
    own: Optional[Dict[str, Any]]  # this rank's own states (None: the checkpoint has no such rank)
    world_size: int  # how many ranks saved it


@dataclass
class Whole:
    """A checkpoint read in one process, with whole tensors: each object's state, and each saved rank's own states."""

    objects: Dict[str, Any]
    ranks: List[Any]


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of a checkpoint not read yet: its dtype (the tensor format's code), whole shape, and how to read it."""

    dtype: str
    shape: Tuple[int, ...]
    read: Callable[[], torch.Tensor]


class Codec(ABC):
    spec: ClassVar[FormatSpec]  # its format: the manifest's `format` number, its name, the check of its own fields
    every_rank_writes: ClassVar[bool]  # False: only rank 0 has files (it saves alone: no collective beyond the plan's)
    catch_all: ClassVar[bool] = False  # it stores any state: asked last (the replicated codec)
    # what saves the same state again and again (the manager, the memory tier) sets: the last plan of
    # each file, reused while the state keeps its structure (reuse.py); None: every file planned anew
    plans: Optional[Plans] = None

    @property
    def format(self) -> int:
        """The manifest's `format` of the checkpoints it writes and reads."""
        return self.spec.number

    @abstractmethod
    def wants(self, objects: Dict[str, Any]) -> bool:
        """Whether this codec is the one for these states (name -> state); codecs are asked in the
        order they were registered, the catch-all one last."""

    @abstractmethod
    def plan(self, objects: Dict[str, Any], own: Dict[str, Any], comm: Collectives) -> Planned:
        """Collective: this rank's files for a save of `objects` (name -> state) and `own` (this rank's states)."""

    def manifest_fields(self, reports: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Rank 0: what the manifest records beyond files and sizes, from every rank's report."""
        return {}

    @abstractmethod
    def load(
        self, files: Files, manifest: Dict[str, Any], objects: Dict[str, Any], own: List[str], rank: int, world_size: int
    ) -> Loaded:
        """This rank's states from a committed checkpoint's `files` (its store's; its manifest validated),
        every file it reads verified. `objects` are the live objects (their current state shows what a rank needs).
        Raises ValueError (the checkpoint is unusable), OSError or MemoryError (it cannot be read now)."""

    @abstractmethod
    def read_whole(self, files: Files, manifest: Dict[str, Any], names: Optional[Sequence[str]] = None) -> Whole:
        """The checkpoint in one process (comparing two runs, sampling from a trained model): the objects
        `names` (None: every one), whole tensors, and every saved rank's own states, every file read
        verified. Raises FileCheckError "missing" for a name it does not hold, else as `load`."""

    def tensors(self, files: Files, manifest: Dict[str, Any], name: str) -> Optional[Dict[str, LazyTensor]]:
        """The tensors of object `name`'s state when it is flat (a model's state_dict: key -> tensor;
        None when it is not), each read when asked: a codec that can read one tensor alone keeps one in
        memory at a time. Raises as `read_whole`."""
        state = self.read_whole(files, manifest, [name]).objects[name]
        if not flat(state):
            return None
        return {
            k: LazyTensor(CODES[t.dtype], tuple(t.shape), partial(_itself, t))
            for k, t in state.items()
            if isinstance(t, torch.Tensor) and t.dtype in CODES
        }

    def layout(self, name: str, roots: Sequence[Any], tree: Any, make: Callable[[], Tuple[Layout, T]]) -> Tuple[Layout, T]:
        """File `name`'s layout (and what `make` returns with it) for a state planned by `make` from
        `roots` (in its order), whose skeleton is `tree`'s: the last plan's, reused while `plans` is
        set and the state's structure is the same (reuse.Plans)."""
        if self.plans is None:
            return make()
        return self.plans.layout(f"{self.format}:{name}", roots, tree, make)

    # A snapshot in memory, unless a codec keeps its own: the objects once per node (local rank 0)
    # and each rank's own state, each a tensor file.
    def snapshot(self, objects: Dict[str, Any], own: Dict[str, Any], writes_objects: bool) -> Dict[str, Layout]:
        """What this rank keeps in memory for a snapshot: buffer name -> layout (`writes_objects`: this
        rank keeps the node's copy of what every rank shares)."""
        out = {OWN: self.layout(OWN, (own,), own, lambda: (tensorfile.plan(own), None))[0]}
        if writes_objects:
            out[SHARED] = self.layout(SHARED, (objects,), objects, lambda: (tensorfile.plan(objects), None))[0]
        return out

    def snapshot_blobs(self) -> List[str]:
        """The buffers a rank reads back to restore from a snapshot ("objects": the node's shared copy; "own": its own)."""
        return [SHARED, OWN]

    def load_snapshot(self, blobs: Dict[str, Any], objects: Dict[str, Any], rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(objects' states, this rank's own states) from a snapshot's verified buffers."""
        shared = tensorfile.parse(blobs[SHARED], SHARED)
        mine = tensorfile.parse(blobs[OWN], OWN)
        if not isinstance(shared, dict) or not all(name in shared for name in objects) or not isinstance(mine, dict):
            raise tensorfile.TensorFileError("the snapshot does not hold every tracked object", "contents")
        return shared, mine


_CODECS: Dict[int, Type[Codec]] = {}  # by format number, in the order registered


def register(codec: Type[Codec]) -> Type[Codec]:
    """A codec module's last word (a class decorator): its format's spec registered (what the manifest
    checks), the codec found by `formats` for a state it wants or a manifest of its format. Its module
    executed again replaces it; another class of the same format is an error."""
    spec = codec.spec
    known = _CODECS.get(spec.number)
    if known is not None and _origin(known) != _origin(codec):
        raise ValueError(f"format {spec.number} is registered by {_origin(known)} and by {_origin(codec)}")
    formatspec.register(spec)
    _CODECS[spec.number] = codec
    return codec


def _origin(codec: Type[Codec]) -> str:
    return f"{codec.__module__}.{codec.__qualname__}"


def codecs() -> List[Type[Codec]]:
    """Every registered codec class, in the order registered."""
    return list(_CODECS.values())
