"""The Store interface: where a checkpoint's bytes go, and what "committed" means there.

A store holds checkpoints by name (`step_<9 digits>`, the layout's names are here), each a set of
files and `manifest.json`. The manager (checkpoint/manager.py) is policy over a store and a codec:
  stage(step)        a new checkpoint's place, invisible to anything that lists (rank 0)
  write(...)         one file, every byte or an error: (bytes, checksum) of what was written (any rank)
  commit(...)        the manifest written last, and the checkpoint visible whole: a rename on a
                     filesystem; on an object store the manifest is the last object put
  names()            the committed checkpoints (a manifest there), in no order
  read_manifest()    a manifest's bytes, bounded (manifest.py validates them)
  open(name, sizes)  a checkpoint's files, read a range at a time and verified (Files)
  set_aside(...)     an unusable checkpoint moved where nothing lists it, never deleted
  discard(name)      retention: invisible at once, then removed
  problem()          why the store cannot be written (the pre-flight: creates nothing)
A store is one module in this package ending in `@register`, found by its location's scheme
(`s3://...`; none: a folder). Nothing here imports torch: the launcher's pre-flight uses it.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from abc import ABC, abstractmethod
from pathlib import PurePath
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, Union

CHECKSUM = "xxh3_128"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d{9,18})")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
SET_ASIDE_PREFIX = ".unusable-"
MAX_MANIFEST_BYTES = 16 << 20  # the training config is in it; 16 MiB is far above any real one
DEFAULT_FOLDER = "checkpoints"  # <run folder>/checkpoints unless checkpoint.dir says otherwise


class FileCheckError(ValueError):
    """A file does not match what its manifest says (size, checksum), or is not a regular file.

    `reason` is a short word for the set-aside folder's name: size, checksum, not-regular, missing."""

    def __init__(self, message: str, reason: str = "damaged") -> None:
        super().__init__(message)
        self.reason = reason


class StoreError(OSError):
    """The store cannot be reached or written (a missing bucket, an unreachable endpoint, no
    permission): the message names the location and the cause."""


def checksum_of(digest: Any) -> str:
    return f"{CHECKSUM}:{digest.hexdigest()}"


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def step_of(name: str) -> Optional[int]:
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def set_aside_name(name: str, reason: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")[:40] or "unusable"
    return f"{SET_ASIDE_PREFIX}{name}-{slug}-{uuid.uuid4().hex[:8]}"


# The random part of a staged or discarded folder's name: seeded from the OS once, not a system call a save
# (uuid4 reads the OS's randomness each time), and seeded again in a forked child, which must not repeat
# its parent's names; never the global `random`, whose stream is the training's.
_NAMES = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_NAMES.seed)


def unique(prefix: str, name: str) -> str:
    return f"{prefix}{name}-{_NAMES.getrandbits(32):08x}"


class Batch:
    """Files written and not yet durable, made durable together with the commit (a filesystem's
    fsyncs side by side); a store whose writes are durable when they return keeps nothing here."""

    def close(self) -> None:
        """Release what a failed save left."""
        return None


class Files(ABC):
    """A checkpoint's files, as a codec reads them: each checked against the manifest's size (and,
    read whole, its checksum). Raises FileCheckError (the file is bad), OSError (it cannot be read now)."""

    @abstractmethod
    def where(self, name: str) -> str:
        """The file's location, for messages."""

    @abstractmethod
    def size(self, name: str) -> int:
        """The file's size, checked against the manifest's."""

    @abstractmethod
    def read(self, name: str, offset: int, length: int) -> Any:
        """`length` bytes at `offset`: a writable buffer (a tensor may be made over it)."""

    @abstractmethod
    def read_verified(self, name: str, size: int, checksum: str) -> bytearray:
        """The whole file, its size and checksum checked."""

    @abstractmethod
    def verify(self, name: str, size: int, checksum: Optional[str]) -> None:
        """Read the file through and check it (without `checksum`: its size only); keeps no copy."""

    def hold(self, name: str, data: Any) -> None:
        """A file already read whole and verified: later reads are served from `data`."""
        return None

    def close(self) -> None:
        """Release what reading held."""
        return None

    def __enter__(self) -> "Files":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Store(ABC):
    """Where a run's checkpoints are (see the module's docstring). `location` as the user wrote it."""

    scheme: ClassVar[str]  # "s3" for s3://...; "" for a plain folder

    def __init__(self, location: str) -> None:
        self.location = location

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    @abstractmethod
    def where(self, name: str = "") -> str:
        """The location of checkpoint (or staged save) `name`, or of the store itself: for messages and records."""

    # ---- writing (rank 0 stages, commits and cleans; every rank may write) ----------------------
    @abstractmethod
    def prepare(self) -> None:
        """Rank 0, once per run: the store exists and takes writes (else StoreError), and what an
        interrupted save or removal left is gone."""

    @abstractmethod
    def stage(self, step: int) -> str:
        """A place for a new checkpoint of `step`, invisible to names() until committed; its name."""

    def batch(self) -> Batch:
        return Batch()

    @abstractmethod
    def write(
        self, staged: str, file: str, pieces: Sequence[Any], batch: Optional[Batch] = None, verify: bool = False
    ) -> Tuple[int, str]:
        """Write `pieces` (buffers, in order) as file `file` of the staged save: (bytes, checksum). With
        `batch` it may become durable only at the commit; with `verify` it is read back and checked
        before this returns. The buffers must not change until then."""

    @abstractmethod
    def commit(self, staged: str, step: int, manifest: bytes, batch: Batch, fence: Any = None) -> Tuple[str, Optional[str]]:
        """Write the manifest last and make the staged save the committed checkpoint of `step`:
        (its name, the name a committed checkpoint of that step already there was set aside to, or
        None). `fence()` (when given) runs right before the step that commits and may raise to stop it."""

    def settle(self) -> None:
        """Make the last commit durable (a filesystem: the rename's folder fsynced)."""
        return None

    @abstractmethod
    def abandon(self, staged: str) -> None:
        """Remove a staged save that will not be committed."""

    # ---- reading --------------------------------------------------------------------------------
    @abstractmethod
    def names(self) -> List[str]:
        """The names of the committed checkpoints (a manifest there), in no order. A folder that is
        not there is empty; a store that cannot be reached now raises StoreError."""

    @abstractmethod
    def read_manifest(self, name: str) -> bytes:
        """The bytes of checkpoint `name`'s manifest, at most MAX_MANIFEST_BYTES (else FileCheckError);
        OSError when it cannot be read."""

    @abstractmethod
    def open(self, name: str, sizes: Dict[str, int]) -> Files:
        """Checkpoint `name`'s files (name -> the manifest's size), for reading."""

    # ---- lifecycle ------------------------------------------------------------------------------
    @abstractmethod
    def set_aside(self, name: str, reason: str) -> str:
        """Move checkpoint `name` where nothing lists it (`.unusable-<name>-<reason>-<id>`), whole; the
        new name. Raises OSError when it cannot."""

    @abstractmethod
    def discard(self, name: str) -> None:
        """Retention: checkpoint `name` invisible at once, then removed."""

    @abstractmethod
    def problem(self) -> Optional[str]:
        """Why checkpoints cannot be written here (None: they can). Creates nothing that stays."""


_STORES: Dict[str, Type[Store]] = {}  # by scheme


def register(store: Type[Store]) -> Type[Store]:
    """A store module's last word (a class decorator): locations `<scheme>://...` open this store."""
    _STORES[store.scheme] = store
    return store


def location(configured: Optional[str], run_folder: Union[str, PurePath]) -> str:
    """Where a run's checkpoints are: `checkpoint.dir` as configured, else <run folder>/checkpoints.
    The one answer the workers, the pre-flight and the report share."""
    return configured if configured else str(PurePath(str(run_folder)) / DEFAULT_FOLDER)


def scheme_of(location: str) -> str:
    m = re.match(r"([a-z][a-z0-9+.-]*)://", location)
    return m.group(1) if m else ""


def schemes() -> List[str]:
    return sorted(_STORES)


def store_for(location: Any) -> Store:
    """The store a checkpoint location names (a folder, or `<scheme>://...`); ValueError for a scheme no store has."""
    text = str(location)
    scheme = scheme_of(text)
    cls = _STORES.get(scheme)
    if cls is None:
        known = ", ".join(f"{s}://" for s in schemes() if s) or "none"
        raise ValueError(f"checkpoint.dir={text}: no store for {scheme}:// (a folder, or one of: {known})")
    return cls(text)


def split(location: Any) -> Tuple[Store, str]:
    """(the store holding it, its name) of a checkpoint's location (`.../checkpoints/step_000000100`)."""
    text = str(location).rstrip("/")
    root, slash, name = text.rpartition("/")
    return store_for(root or ("/" if slash else ".")), name
