"""Per-step snapshots in shared memory: a worker's death costs at most a few steps, and the resume stays exact.

Every `snapshot.every_n_steps` steps each node copies exactly what a committed checkpoint holds into
shared memory (/dev/shm), which outlives the workers: local rank 0 the objects every rank shares
(model, optimizer, scheduler, progress and data position: the same on every rank after a step),
and every rank its own RNG states. Each of those is a double buffer: two slot files, written in
turn. A slot's header says which snapshot it holds (sequence number, step, size, xxh3 of the
bytes); the writer first marks the slot empty, then copies, then writes the header, so a death in
the middle of a copy leaves a slot that never verifies, and the other slot is used.

After a failure the new workers look at their node's newest complete snapshot (both the shared
objects and their own rank's state at the same step, verified), and all ranks agree: when every
rank has the same step and it is newer than the newest committed checkpoint, they restore from
memory; otherwise from disk, together. The launcher names the job's segments (LaunchEnv.snapshot),
removes them when the job ends, and removes segments a killed launcher left behind. A snapshot is
never retained, listed as a checkpoint, or moved between machines: disk checkpoints keep their
cadence and their role (node loss, a new launch, another machine).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import xxhash

from .checkpoint import tensorfile
from .checkpoint.tensorwrite import plan
from .contract.events import Event
from .contract.shm import SHM_DIR

log = logging.getLogger(__name__)

MAGIC = b"SFSNAP01"
HEADER = struct.Struct("<8sQQQ16sQ")  # magic, sequence (0: empty), step, payload bytes, xxh3-128 digest, world size
HEADER_BYTES = 4096  # the payload starts on its own page
EMPTY = HEADER.pack(MAGIC, 0, 0, 0, b"\0" * 16, 0)
OBJECTS, RANK = "objects", "rank"
MEMORY_SHARE = 0.02  # snapshot.every_n_steps=auto: snapshots cost at most this share of the training time


class Slot:
    """One buffer: a file in shared memory with a header page and the payload. The writer keeps it
    mapped (a snapshot is then one copy and one hash); readers open it fresh."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: Optional[mmap.mmap] = None
        self.seq = self.step = 0  # what this process last wrote here (0: nothing yet)

    def _mapped(self, size: int) -> mmap.mmap:
        if self._map is None or len(self._map) < HEADER_BYTES + size:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < HEADER_BYTES + size:
                    # reserved now: a full tmpfs fails here (ENOSPC), not with SIGBUS in a copy
                    os.posix_fallocate(fd, 0, HEADER_BYTES + size)
                if self._map is not None:
                    self._map.close()
                self._map = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return self._map

    def write(
        self, seq: int, step: int, world_size: int, pieces: List[Any], size: int, halfway: Optional[Callable[[], None]] = None
    ) -> None:
        m = self._mapped(size)
        m[: HEADER.size] = EMPTY  # empty until the copy is whole
        digest, offset = xxhash.xxh3_128(), HEADER_BYTES
        for i, piece in enumerate(pieces):
            if halfway is not None and i == len(pieces) // 2:
                halfway()
            view = memoryview(piece).cast("B")
            m[offset : offset + view.nbytes] = view
            digest.update(view)
            offset += view.nbytes
        m[: HEADER.size] = HEADER.pack(MAGIC, seq, step, size, digest.digest(), world_size)
        self.seq, self.step = seq, step

    def header(self) -> Optional[Tuple[int, int, int, bytes, int]]:
        """(sequence, step, size, digest, world size) of a filled slot, else None (never raises)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(HEADER.size)
        except OSError:
            return None
        if len(raw) != HEADER.size:
            return None
        magic, seq, step, size, digest, world = HEADER.unpack(raw)
        return (seq, step, size, digest, world) if magic == MAGIC and seq > 0 else None

    def read(self) -> Optional[Tuple[int, int, Any]]:
        """(sequence, step, state) when the slot is filled and its bytes verify, else None (never raises)."""
        head = self.header()
        if head is None:
            return None
        seq, step, size, digest, _ = head
        try:
            with open(self.path, "rb") as f:
                f.seek(HEADER_BYTES)
                data = bytearray(size)
                if f.readinto(data) != size or xxhash.xxh3_128(data).digest() != digest:
                    return None
            return seq, step, tensorfile.parse(data, str(self.path))
        except (OSError, ValueError, MemoryError):
            return None

    def clear(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except OSError:
            return
        try:
            os.pwrite(fd, EMPTY, 0)
        finally:
            os.close(fd)
        self.seq = self.step = 0


class Buffer:
    """A double buffer: the slot to write next is the one not holding the newest snapshot."""

    def __init__(self, prefix: str, name: str) -> None:
        self.slots = [Slot(SHM_DIR / f"{prefix}.{name}.{k}") for k in "ab"]
        self._known = False  # whether the slots' contents are known to this process (it wrote or read them)

    def write(self, seq: int, step: int, world_size: int, layout: Any, halfway: Optional[Callable[[], None]] = None) -> int:
        if not self._known:  # what an earlier incarnation left: the older slot goes first
            for slot in self.slots:
                head = slot.header()
                slot.seq, slot.step = (head[0], head[1]) if head else (0, 0)
            self._known = True
        older = min(self.slots, key=lambda slot: slot.seq)
        older.write(seq, step, world_size, layout.buffers(), layout.size, halfway)
        return layout.size

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
    """This rank's part of the node's snapshots (see the module's docstring)."""

    def __init__(self, prefix: str, rank: int, local_rank: int, world_size: int) -> None:
        self.prefix, self.rank, self.world_size = prefix, rank, world_size
        self.writes_objects = local_rank == 0
        self.objects = Buffer(prefix, OBJECTS)
        self.own = Buffer(prefix, f"{RANK}{rank}")
        self.seq = int(time.time() * 1000)  # grows across incarnations of the workers
        self.bytes = 0
        self.seconds: Optional[float] = None  # the last snapshot's cost on this rank

    def plan(self, objects: Dict[str, Any], per_rank: Dict[str, Any]) -> List[Tuple[Buffer, Any]]:
        """What this rank writes now: its own state, and on local rank 0 the shared objects."""
        out = [(self.own, plan({name: obj.state_dict() for name, obj in per_rank.items()}))]
        if self.writes_objects:
            out.append((self.objects, plan({name: obj.state_dict() for name, obj in objects.items()})))
        return out

    def take(self, step: int, planned: List[Tuple[Buffer, Any]], halfway: Optional[Callable[[], None]] = None) -> None:
        started = time.perf_counter()
        self.seq += 1
        self.bytes = sum(
            buffer.write(self.seq, step, self.world_size, layout, halfway if buffer is self.objects else None)
            for buffer, layout in planned
        )
        self.seconds = time.perf_counter() - started

    def steps(self) -> List[int]:
        """The steps at which both this node's shared objects and this rank's own state are filled
        (bytes are verified when loading), newest first."""
        shared, own = self.objects.complete(self.world_size), self.own.complete(self.world_size)
        return sorted((s for s in shared if s in own), reverse=True)

    def load(self, step: int) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
        """(objects' states, this rank's states) at `step`, verified, else None."""
        found = []
        for buffer in (self.objects, self.own):
            entry = buffer.complete().get(step)
            got = entry[1].read() if entry else None
            if got is None or got[1] != step:
                return None
            found.append(got[2])
        return found[0], found[1]

    def discard_after(self, step: int) -> None:
        self.own.discard_after(step)
        if self.writes_objects:
            self.objects.discard_after(step)


class MemoryCadence:
    """When a run takes its snapshots (snapshot.every_n_steps), and what it tells a person about them.

    auto: every step when a snapshot costs under MEMORY_SHARE of a step, else the smallest interval
    at which it does, from the slowest rank's snapshot time and rank 0's step time (both agreed,
    so every rank snapshots at the same steps). The first snapshot checks, on every node, that two
    copies fit in the shared-memory filesystem; if one node has no room, all of them go without."""

    def __init__(self, run: Any, memory: MemorySnapshots, every: Any) -> None:
        self.run, self.memory = run, memory
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)
        self._first = True

    @classmethod
    def start(cls, every: Any, run: Any) -> Optional["MemoryCadence"]:
        if every == 0 or not run.launch.snapshot:
            return None
        if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
            cls._off(run, f"{SHM_DIR} is not a writable folder here")
            return None
        memory = MemorySnapshots(run.launch.snapshot, run.rank, run.local_rank, run.world_size)
        run.checkpointer.memory = memory
        return cls(run, memory, every)

    @staticmethod
    def _off(run: Any, why: str) -> None:
        log.warning(
            "Snapshots in memory are off: %s. After a failure the run resumes from the newest checkpoint on "
            "disk. (snapshot.every_n_steps=0 turns them off without this message.)",
            why,
        )
        run.record.event(Event.SNAPSHOT_UNAVAILABLE, reason=why)
        run._memory = run.checkpointer.memory = None

    def at_step(self, step: int) -> None:
        if step % self.every:
            return
        run, memory = self.run, self.memory
        started = time.perf_counter()
        planned = memory.plan(run.checkpointer.objects, run.checkpointer.per_rank)
        if self._first:  # every rank takes the same decision: a node without room turns them off everywhere
            self._first = False
            problem = fits(run.launch.snapshot, sum(layout.size for _, layout in planned)) if memory.writes_objects else None
            if run.comm.max_each([1.0 if problem else 0.0])[0]:
                self._off(run, problem or "another node's shared memory is too small for them")
                return
            announce = True
        else:
            announce = False
        try:
            memory.take(step, planned, lambda: run.faults.during_snapshot(step))
        except OSError as exc:
            self._off(run, f"writing to {SHM_DIR} failed ({exc.strerror or exc})")
            raise  # the ranks must stop snapshotting together: a failure here is a failure of the step
        memory.seconds = time.perf_counter() - started
        if announce and run.rank == 0:
            log.info(
                "Snapshots in memory: %.1f MB per node (two copies in %s), every %s step(s)",
                memory.bytes / 1e6,
                SHM_DIR,
                f"auto: {self.every}" if self.auto else self.every,
            )
            self._record(memory.seconds)

    def retune(self, step_seconds: Optional[float]) -> None:
        if not self.auto or not step_seconds:
            return
        cost = self.run.comm.max_each([self.memory.seconds or 0.0])[0]
        every = max(1, math.ceil(cost / (MEMORY_SHARE * step_seconds)))
        if every != self.every and self.run.rank == 0:
            self.every = every
            self._record(cost, step_seconds=round(step_seconds, 5))
        self.every = every

    def _record(self, seconds: float, **fields: Any) -> None:
        self.run.record.event(
            Event.SNAPSHOT_CREATED,
            bytes=self.memory.bytes,
            every_n_steps=self.every,
            auto=self.auto,
            segment=self.run.launch.snapshot,
            seconds=round(seconds, 5),
            **fields,
        )


def fits(prefix: str, nbytes: int) -> Optional[str]:
    """None when two copies of `nbytes` fit in the shared-memory filesystem; else why not."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR} is not available ({exc.strerror or exc})"
    free = st.f_bavail * st.f_frsize
    used = sum(p.stat().st_size for p in SHM_DIR.glob(f"{prefix}.*") if p.is_file())
    need = 2 * (nbytes + HEADER_BYTES)
    if free + used < need:
        return f"{SHM_DIR} has {free / 2**20:.0f} MiB free and the snapshots need {need / 2**20:.0f} MiB (two copies)"
    return None
