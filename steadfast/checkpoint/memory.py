"""Per-step snapshots in shared memory: a worker's death costs at most a few steps, and the resume stays exact.

Every `snapshot.every_n_steps` steps (steadfast/loop/memory_cadence.py says when) each node copies
exactly what a committed checkpoint holds into shared memory (/dev/shm), which outlives the
workers: local rank 0 the objects every rank shares (model, optimizer, scheduler, progress and data
position: the same on every rank after a step), and every rank its own RNG states. Each of those is a double buffer: two slot files, written in
turn. A slot's header says which snapshot it holds (sequence number, step, size, world size and a
digest); the writer first marks the slot empty, then copies, then writes the header, so a death in
the middle of a copy leaves a slot that never verifies, and the other slot is used.

The slot files are in the launch's private folder (steadfast/contract/shm.py: mode 0700, checked;
files created exclusively, never through a symlink, checked with fstat before use). The digest is
keyed with the launch's key: xxh3-128 of the bytes, seeded from the key, then BLAKE2b keyed with it
over the header's fields and that hash; so a snapshot of another launch, or one forged without the
key, never verifies. The bytes are written with write(2), by the checkpoint files' write loop (storage/fileio.py), not through a mapping: a file truncated by
someone else while it is written costs that snapshot (it does not verify), never the worker
(a store into a mapping past the end of the file is SIGBUS). A reader checks the header's size
against the file's before it allocates anything, and never raises.

After a failure the new workers look at their node's newest complete snapshot (both the shared
objects and their own rank's state at the same step, verified), and all ranks agree: when every
rank has the same step and it is newer than the newest committed checkpoint, they restore from
memory; otherwise from disk, together. The launcher names the job's segments (LaunchEnv.snapshot),
removes them when the job ends, and removes segments a killed launcher left behind. A snapshot is
never retained, listed as a checkpoint, or moved between machines: disk checkpoints keep their
cadence and their role (node loss, a new launch, another machine).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import xxhash

from ..contract.events import Event
from ..contract.shm import SHM_DIR, Segments
from . import tensorfile
from .codec import OWN, SHARED, Codec, state_of
from .formats import for_state
from .replicated import ReplicatedCodec
from .reuse import Plans
from .sharded import ShardedCodec
from .storage import fileio

log = logging.getLogger(__name__)

MAGIC = b"SFSNAP02"  # 02: the digest is keyed
HEADER = struct.Struct("<8sQQQ16sQ")  # magic, sequence (0: empty), step, payload bytes, keyed digest, world size
FIELDS = struct.Struct("<8sQQQQ")  # what the keyed digest covers besides the bytes' hash
HEADER_BYTES = 4096  # the payload starts on its own page
EMPTY = HEADER.pack(MAGIC, 0, 0, 0, b"\0" * 16, 0)
RANK = "rank"  # this rank's buffer is rank<r>
FAILURES = (OSError, ValueError, MemoryError, OverflowError, RuntimeError)  # a slot that cannot be read: None


class Keyed:
    """The launch's key, as the two things a digest needs: xxh3's seed and BLAKE2b's key."""

    def __init__(self, key: bytes) -> None:
        self.seed = int.from_bytes(hashlib.blake2b(b"xxh3 seed", key=key, digest_size=8).digest(), "little")
        self.key = key

    def digest(self, seq: int, step: int, size: int, world: int, data_hash: bytes) -> bytes:
        fields = FIELDS.pack(MAGIC, seq, step, size, world)
        return hashlib.blake2b(fields + data_hash, key=self.key, digest_size=16).digest()


class Slot:
    """One buffer: a file in the launch's folder with a header page and the payload. The writer
    keeps its (checked) descriptor; readers open and check the file afresh."""

    def __init__(self, segments: Segments, name: str, keyed: Keyed) -> None:
        self.segments, self.name, self.keyed = segments, name, keyed
        self.path = segments.path / name
        self._fd = -1
        self.seq = self.step = 0  # what this process last wrote here (0: nothing yet)

    def _writable(self, size: int) -> int:
        if self._fd < 0:
            self._fd = self.segments.open(self.name, "create")
        if os.fstat(self._fd).st_size < HEADER_BYTES + size:
            os.posix_fallocate(self._fd, 0, HEADER_BYTES + size)  # reserved now: a full tmpfs fails here (ENOSPC)
        return self._fd

    def write(
        self, seq: int, step: int, world_size: int, pieces: List[Any], size: int, halfway: Optional[Callable[[], None]] = None
    ) -> None:
        fd = self._writable(size)
        fileio.write_at(fd, EMPTY, 0)  # empty until the copy is whole
        data_hash = xxhash.xxh3_128(seed=self.keyed.seed)
        views = [memoryview(piece).cast("B") for piece in pieces]
        half = len(views) // 2 if halfway is not None else len(views)
        os.lseek(fd, HEADER_BYTES, os.SEEK_SET)
        fileio.write_views(fd, views[:half], data_hash)  # the checkpoint files' write loop: whole, gathered
        if halfway is not None:
            halfway()
        fileio.write_views(fd, views[half:], data_hash)
        digest = self.keyed.digest(seq, step, size, world_size, data_hash.digest())
        fileio.write_at(fd, HEADER.pack(MAGIC, seq, step, size, digest, world_size), 0)
        self.seq, self.step = seq, step

    def _header(self, fd: int) -> Optional[Tuple[int, int, int, bytes, int]]:
        raw = os.pread(fd, HEADER.size, 0)
        if len(raw) != HEADER.size:
            return None
        magic, seq, step, size, digest, world = HEADER.unpack(raw)
        if magic != MAGIC or seq == 0 or size > os.fstat(fd).st_size - HEADER_BYTES:
            return None  # empty, not ours, or claims more bytes than the file holds
        return seq, step, size, digest, world

    def header(self) -> Optional[Tuple[int, int, int, bytes, int]]:
        """(sequence, step, size, digest, world size) of a filled slot, else None (never raises)."""
        try:
            fd = self.segments.open(self.name, "read")
        except OSError:
            return None
        try:
            return self._header(fd)
        except FAILURES:
            return None
        finally:
            os.close(fd)

    def read(self) -> Optional[Tuple[int, int, Any]]:
        """(sequence, step, state) when the slot is filled and its bytes verify, else None (never raises)."""
        got = self.read_bytes()
        if got is None:
            return None
        try:
            return got[0], got[1], tensorfile.parse(got[2], str(self.path))
        except FAILURES:
            return None

    def read_bytes(self) -> Optional[Tuple[int, int, bytearray]]:
        """(sequence, step, bytes) when the slot is filled and its bytes verify, else None (never raises)."""
        try:
            fd = self.segments.open(self.name, "read")
        except OSError:
            return None
        try:
            head = self._header(fd)
            if head is None:
                return None
            seq, step, size, digest, world = head
            data = bytearray(size)  # at most the file's size
            view, pos = memoryview(data), 0
            while pos < size:
                n = os.preadv(fd, [view[pos:]], HEADER_BYTES + pos)
                if n <= 0:
                    return None  # shorter than its header says (truncated since)
                pos += n
            expected = self.keyed.digest(seq, step, size, world, xxhash.xxh3_128(data, seed=self.keyed.seed).digest())
            if not hmac.compare_digest(digest, expected):
                return None
            return seq, step, data
        except FAILURES:
            return None
        finally:
            os.close(fd)

    def clear(self) -> None:
        try:
            fd = self.segments.open(self.name, "write")
        except OSError:
            return
        try:
            os.pwrite(fd, EMPTY, 0)
        finally:
            os.close(fd)
        self.seq = self.step = 0


class Buffer:
    """A double buffer (or more, `count`): the slot to write next is the oldest of those that hold
    neither the newest snapshot (a death in the middle of the copy leaves it) nor the newest at or
    before a protected step."""

    def __init__(self, segments: Segments, name: str, keyed: Keyed, count: int = 2) -> None:
        self.slots = [Slot(segments, f"{name}.{k}", keyed) for k in "abcd"[:count]]
        self._known = False  # whether the slots' contents are known to this process (it wrote or read them)

    def write(
        self,
        seq: int,
        step: int,
        world_size: int,
        layout: Any,
        halfway: Optional[Callable[[], None]] = None,
        protect: Sequence[int] = (),
    ) -> int:
        """`protect`: steps, most important first, whose newest snapshot at or before each is kept
        while another slot is left to write (the anomaly guard's: the newest known healthy, and the
        newest whose health is being agreed)."""
        if not self._known:  # what an earlier incarnation left: the older slot goes first
            for slot in self.slots:
                head = slot.header()
                slot.seq, slot.step = (head[0], head[1]) if head else (0, 0)
            self._known = True
        free = list(self.slots)
        filled = [slot for slot in free if slot.seq]
        kept = [max(filled, key=lambda slot: slot.seq)] if filled else []
        for bound in protect:
            held = [slot for slot in filled if slot.step <= bound]
            kept += [max(held, key=lambda slot: (slot.step, slot.seq))] if held else []
        for slot in kept:
            if slot in free and len(free) > 1:
                free.remove(slot)
        older = min(free, key=lambda slot: slot.seq)
        older.write(seq, step, world_size, layout.buffers(), layout.size, halfway)
        return int(layout.size)  # layout: the codec's, untyped here

    def complete(self, world_size: Optional[int] = None) -> Dict[int, Tuple[int, Slot]]:
        """step -> (sequence, slot) of every filled slot (of that world size; bytes not yet verified)."""
        out: Dict[int, Tuple[int, Slot]] = {}
        for slot in self.slots:
            head = slot.header()
            if head is None or (world_size is not None and head[4] != world_size):
                continue
            seq, step = head[0], head[1]
            if step not in out or seq > out[step][0]:
                out[step] = (seq, slot)
        return out

    def discard_after(self, step: int) -> None:
        """Forget snapshots newer than `step` (another timeline: the run resumed from an older step)."""
        for slot in self.slots:
            head = slot.header()
            if head is not None and head[1] > step:
                slot.clear()
        self._known = False


class MemorySnapshots:
    """This rank's part of the node's snapshots (see the module's docstring). What goes into them is
    the codec's (checkpoint/codec.py): the replicated one keeps the objects once per node (local
    rank 0, `objects`) and each rank's own state (`own`); the sharded one each rank's file, its
    pieces and every unsharded tensor (`own` alone)."""

    def __init__(self, segments: Segments, rank: int, local_rank: int, world_size: int, copies: int = 2) -> None:
        self.segments, self.rank, self.world_size, self.copies = segments, rank, world_size, copies
        self.writes_objects = local_rank == 0
        keyed = Keyed(segments.key)
        self.buffers = {
            SHARED: Buffer(segments, SHARED, keyed, copies),
            OWN: Buffer(segments, f"{RANK}{rank}", keyed, copies),
        }
        self.seq = int(time.time() * 1000)  # grows across incarnations of the workers
        self.bytes = 0
        self.seconds: Optional[float] = None  # the last snapshot's cost on this rank
        self.plans = Plans()
        # A sharded file is reused however few its tensors: a DTensor's piece (its mesh coordinate, its
        # box, its local tensor) costs several plain tensors' plan, and a snapshot is planned every few
        # steps for the whole run (FSDP2's hot loop: 0.65 -> 0.35 CPU ms of a 2 ms snapshot).
        self.sharded_plans = Plans(small=0)

    @property
    def folder(self) -> Path:
        return self.segments.path

    def plan(self, objects: Dict[str, Any], per_rank: Dict[str, Any]) -> List[Tuple[Buffer, Any]]:
        """What this rank writes now (buffer, layout), as the state's codec says."""
        states = {name: state_of(obj) for name, obj in objects.items()}
        own = {name: state_of(obj) for name, obj in per_rank.items()}
        codec = for_state(states)
        # the last snapshot's layouts, reused while the state keeps its structure
        codec.plans = self.sharded_plans if isinstance(codec, ShardedCodec) else self.plans
        blobs = codec.snapshot(states, own, self.writes_objects)
        return [(self.buffers[name], layout) for name, layout in blobs.items()]

    def take(
        self,
        step: int,
        planned: List[Tuple[Buffer, Any]],
        halfway: Optional[Callable[[], None]] = None,
        protect: Sequence[int] = (),
    ) -> None:
        started = time.perf_counter()
        self.seq += 1
        shared = self.buffers[SHARED]
        self.bytes = sum(
            buffer.write(
                self.seq, step, self.world_size, layout, halfway if buffer is shared or len(planned) == 1 else None, protect
            )
            for buffer, layout in planned
        )
        self.seconds = time.perf_counter() - started

    def keep(self, copies: int) -> None:
        """Fewer copies of each buffer than it was opened with (before the first snapshot)."""
        self.copies = copies
        for buffer in self.buffers.values():
            buffer.slots = buffer.slots[:copies]

    @property
    def objects(self) -> Buffer:
        return self.buffers[SHARED]

    @property
    def own(self) -> Buffer:
        return self.buffers[OWN]

    def _codec(self, objects: Optional[Dict[str, Any]]) -> Codec:
        return for_state({n: state_of(o) for n, o in objects.items()}) if objects is not None else ReplicatedCodec()

    def steps(self, objects: Optional[Dict[str, Any]] = None) -> List[int]:
        """The steps at which every buffer the codec of these live objects reads is filled on this
        rank (bytes are verified when loading), newest first."""
        filled = [set(self.buffers[name].complete(self.world_size)) for name in self._codec(objects).snapshot_blobs()]
        return sorted(set.intersection(*filled), reverse=True)

    def load(self, step: int, objects: Optional[Dict[str, Any]] = None) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
        """(objects' states, this rank's states) at `step` for these live objects, verified, else None."""
        codec, blobs = self._codec(objects), {}
        for name in codec.snapshot_blobs():
            entry = self.buffers[name].complete().get(step)
            got = entry[1].read_bytes() if entry else None
            if got is None or got[1] != step:
                return None
            blobs[name] = got[2]
        try:
            return codec.load_snapshot(blobs, objects or {}, self.rank)
        except FAILURES:
            return None

    def discard_after(self, step: int) -> None:
        self.buffers[OWN].discard_after(step)
        if self.writes_objects:
            self.buffers[SHARED].discard_after(step)


def open_memory(
    every: Union[int, str], segment: Optional[str], rank: int, local_rank: int, world_size: int, copies: int = 2
) -> Tuple[Optional[MemorySnapshots], Optional[str]]:
    """This rank's snapshots in the launch's private folder, or (None, why not); (None, None): off.
    `copies`: 4 where the anomaly guard keeps one known healthy and one being agreed besides the two."""
    if every == 0 or not segment:
        return None, None
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
        return None, f"{SHM_DIR} is not a writable folder here"
    try:
        return MemorySnapshots(Segments(segment), rank, local_rank, world_size, copies), None
    except OSError as exc:
        return None, f"the launch's private folder {SHM_DIR / segment} cannot be used ({exc.strerror or exc})"


def announce_off(record: Callable[..., None], why: str) -> None:
    log.warning(
        "Snapshots in memory are off: %s. After a failure the run resumes from the newest checkpoint on "
        "disk. (snapshot.every_n_steps=0 turns them off without this message.)",
        why,
    )
    record(Event.SNAPSHOT_UNAVAILABLE, reason=why)


def fits(segments: Segments, nbytes: int, copies: int = 2) -> Optional[str]:
    """None when `copies` copies of `nbytes` fit in the shared-memory filesystem; else why not."""
    try:
        st = os.fstatvfs(segments.fd)
        used = segments.used_bytes()  # what the launch's snapshots hold now, freed when they are rewritten
    except OSError as exc:
        return f"{SHM_DIR} is not available ({exc.strerror or exc})"
    free = st.f_bavail * st.f_frsize
    need = copies * (nbytes + HEADER_BYTES)
    if free + used < need:
        many = {2: "two", 4: "four"}.get(copies, str(copies))
        return f"{SHM_DIR} has {free / 2**20:.0f} MiB free and the snapshots need {need / 2**20:.0f} MiB ({many} copies)"
    return None
