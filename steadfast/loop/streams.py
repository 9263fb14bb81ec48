"""Data for a loop of steps (`run.steps`): random batches and iterable data that resume exactly.

A step loop draws its batches as it goes (nanoGPT's `get_batch`: `torch.randint` over a memmap of
tokens) and often draws one ahead of the step (the next batch fetched before the backward pass of
the last micro-batch). The random state at a step boundary is then past that batch, and the batch
itself is held by a local variable the checkpoint cannot see: a resume that restores the random
state draws the batch after it, and trains on other data without a word.

The sources here count what the steps took, not what was drawn. Each is a stream of batches
numbered 0, 1, 2, ...; a checkpoint records, per source, how many batches the steps before it took
(`per_step` each: the run's accumulate_grad_batches unless given), in the loop's progress. After a
resume the source starts again at that number, so the first batch drawn (the one fetched ahead of
the loop) is the one the interrupted run had fetched ahead.

- `RandomBatches` (run.random_batches): batch i of rank r is `fn(*args, generator=g, **kwargs)`,
  g a CPU torch.Generator seeded from (the run's seed, the source, r, i): the stream depends on
  nothing but those numbers, so no random state needs saving and the global RNG is left alone.
- `IterableStream` (run.stream): batches of an iterable (a DataLoader over an IterableDataset, any
  re-iterable) pass after pass; a DataLoader's generator and its sampler's (shuffle=True) are seeded
  from (seed, source, pass) at each pass, so a pass's order depends on its number only. A resume
  skips the passes before its position (by len(), checked at every pass's end) and reads and drops
  the batches of its pass before it.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Callable, Iterable, Iterator, List, Optional

import torch

from ..checkpoint.state import Progress


class StreamError(RuntimeError):
    """A source used in a way that would not resume exactly (the message says how to fix it)."""


class Source:
    """One numbered stream of batches whose position is what the steps took (`per_step` a step)."""

    kind = "source"

    def __init__(self, progress: Progress, index: int, per_step: int, seed: int, ready: Callable[[], bool]) -> None:
        self.progress, self.index, self.per_step, self.seed, self.ready = progress, index, per_step, seed, ready
        self.next: Optional[int] = None  # the number of the next batch to draw (None: none drawn by these workers yet)
        self.ahead: Optional[int] = None  # batches drawn beyond what the steps took, at the last step boundary

    @property
    def taken(self) -> int:
        """Batches the steps so far took from this source (the position a checkpoint records)."""
        streams = self.progress.streams
        if len(streams) <= self.index:  # a checkpoint of a run with fewer sources: this one starts at 0
            streams.extend([0] * (self.index + 1 - len(streams)))
        return streams[self.index]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.next is None:
            if not self.ready():
                raise StreamError(
                    f"{self.kind}: the first batch was drawn before run.resume(...); draw it after, so that a resumed "
                    "run continues where its checkpoint left the stream"
                )
            self.next = self.taken
        batch = self.draw(self.next)
        self.next += 1
        return batch

    def draw(self, number: int) -> Any:
        raise NotImplementedError

    def stepped(self, step: int) -> None:
        """A step is done: it took `per_step` batches. The batches drawn beyond them (one fetched ahead)
        must be as many at every step, or the count is not what the loop does."""
        self.progress.streams[self.index] = self.taken + self.per_step
        if self.next is None:
            return
        ahead = self.next - self.taken
        if ahead < 0 or (self.ahead is not None and ahead != self.ahead):
            before = "" if self.ahead is None else f" ({self.ahead} at the step before)"
            raise StreamError(
                f"{self.kind}: at step {step} the loop had drawn {ahead:+d} batch(es) beyond the {self.per_step} a step "
                f"takes (per_step){before}: a step must draw as many as it trains on. Give per_step= the batches each "
                "optimizer step trains on (or accumulate_grad_batches= to sf.Run), and draw anything else (an "
                "evaluation's batches) from the global RNG or a torch.Generator seeded from the step"
            )
        self.ahead = ahead


def stream_seed(*numbers: int) -> int:
    """A 63-bit seed from a tuple of numbers (independent streams for neighbouring tuples)."""
    packed = struct.pack(f"<{len(numbers)}q", *[n % 2**63 for n in numbers])
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


class RandomBatches(Source):
    """Batch i of this rank: `fn(*args, generator=g, **kwargs)` with g seeded from (seed, source, rank, i)."""

    kind = "run.random_batches"

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        rank: int,
        progress: Progress,
        index: int,
        per_step: int,
        seed: int,
        ready: Callable[[], bool],
    ) -> None:
        super().__init__(progress, index, per_step, seed, ready)
        self.fn, self.args, self.kwargs, self.rank = fn, args, kwargs, rank
        self.generator = torch.Generator()

    def draw(self, number: int) -> Any:
        self.generator.manual_seed(stream_seed(self.seed, self.index, self.rank, number))
        return self.fn(*self.args, generator=self.generator, **self.kwargs)


class IterableStream(Source):
    """The batches of `iterable`, pass after pass; a resume reads and drops those before its position."""

    kind = "run.stream"

    def __init__(
        self, iterable: Iterable[Any], progress: Progress, index: int, per_step: int, seed: int, ready: Callable[[], bool]
    ) -> None:
        super().__init__(progress, index, per_step, seed, ready)
        self.iterable = iterable
        self.passes = 0  # the pass under way (0 first)
        self._batches: Optional[Iterator[Any]] = None
        self._at = 0  # the number of the batch the open pass hands out next
        self.length = 0  # batches in a pass, as len() says (0: it does not)

    def _open(self, number: int) -> None:
        """Seed and open pass `number` (its set_epoch called where the iterable has one)."""
        self.passes = number
        parts: List[Any] = [self.iterable, getattr(self.iterable, "sampler", None), getattr(self.iterable, "dataset", None)]
        for part in parts:
            set_epoch = getattr(part, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(number)
        if isinstance(self.iterable, torch.utils.data.DataLoader):  # its own generator and its sampler's (shuffle=True)
            for part in (self.iterable, self.iterable.sampler):
                if hasattr(part, "generator"):
                    generator = part.generator or torch.Generator()
                    generator.manual_seed(stream_seed(self.seed, self.index, number))
                    part.generator = generator
        rng = torch.get_rng_state()  # a DataLoader without a generator would draw its seed from the global RNG:
        self._batches = iter(self.iterable)
        torch.set_rng_state(rng)  # a resumed run must see the same random numbers as the uninterrupted one

    def _next_of_pass(self) -> Any:
        """The open pass's next batch; at its end, the next pass's first. A pass must have as many
        batches as len() says when it says (a resume skips whole passes by it)."""
        assert self._batches is not None
        try:
            return next(self._batches)
        except StopIteration:
            if self._at == 0 or (self.length and self._at != self.length):
                said = f", len() says {self.length}" if self.length else ""
                raise StreamError(
                    f"{self.kind}: pass {self.passes} of the iterable gave {self._at} batch(es){said}; a resume could not "
                    "find its place (give an iterable whose passes are not empty and whose len(), if any, is right)"
                ) from None
        self._open(self.passes + 1)
        self._at = 0
        try:
            return next(self._batches)
        except StopIteration:
            raise StreamError(f"{self.kind}: pass {self.passes} of the iterable gave no batch") from None

    def draw(self, number: int) -> Any:
        if self._batches is None:  # these workers' first batch: skip to `number`, whole passes at once by len()
            self.length = _length(self.iterable)
            first_pass = number // self.length if self.length else 0
            self._open(first_pass)
            self._at = 0
            for _ in range(number - first_pass * self.length):
                self._next_of_pass()
                self._at += 1
        batch = self._next_of_pass()
        self._at += 1
        return batch


def _length(iterable: Any) -> int:
    """Batches in one pass, when the iterable says (0: unknown)."""
    try:
        return max(0, int(len(iterable)))
    except (TypeError, NotImplementedError):
        return 0


class Sources:
    """The run's step-loop sources, their positions kept in the loop's progress (Progress.streams)."""

    def __init__(self, progress: Progress, seed: int, rank: int, per_step: int) -> None:
        self.progress, self.seed, self.rank, self.per_step = progress, seed, rank, per_step
        self.all: List[Source] = []
        self.resumed = False  # run.resume has run: the positions are the checkpoint's

    def _slot(self, per_step: Optional[int]) -> tuple[int, int]:
        if per_step is None:
            per_step = self.per_step
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
            raise ValueError(f"per_step={per_step!r}: the number of batches each optimizer step takes from the source, >= 1")
        index = len(self.all)
        while len(self.progress.streams) <= index:
            self.progress.streams.append(0)
        return index, per_step

    def random(self, fn: Callable[..., Any], args: Any, kwargs: Any, per_step: Optional[int]) -> RandomBatches:
        index, per_step = self._slot(per_step)
        source = RandomBatches(fn, args, kwargs, self.rank, self.progress, index, per_step, self.seed, self._ready)
        self.all.append(source)
        return source

    def iterable(self, iterable: Iterable[Any], per_step: Optional[int]) -> IterableStream:
        if not hasattr(iterable, "__iter__") or hasattr(iterable, "__next__"):
            raise TypeError(
                f"run.stream({type(iterable).__name__}): needs something iterated pass after pass (a DataLoader, a "
                "dataset), not an iterator (it cannot start again)"
            )
        index, per_step = self._slot(per_step)
        source = IterableStream(iterable, self.progress, index, per_step, self.seed, self._ready)
        self.all.append(source)
        return source

    def _ready(self) -> bool:
        return self.resumed

    def stepped(self, step: int) -> None:
        for source in self.all:
            source.stepped(step)
