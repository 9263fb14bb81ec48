"""Data that resumes exactly: a sampler that can start anywhere in an epoch, for any world size.

`run.loader(dataset, batch_size)` (steadfast.Run) gives each rank its shard of one global
permutation per epoch, positioned where the run stands; in-memory tensor datasets are fetched a
batch at a time by index (no per-sample `__getitem__` and collate).

A rollback (steadfast/health/) moves the position back and may leave data out: what it skipped is in
the progress (`Progress.skipped`: ranges of an epoch's order), so a resume and a re-run skip the same
samples; the run's loaders then start again from the restored position (`RunData.rewind`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils.data import Dataset, Sampler, TensorDataset

from ..checkpoint.state import Progress
from ..contract.events import Event
from .streams import Sources

log = logging.getLogger(__name__)


class ResumableSampler(Sampler[int]):
    """DistributedSampler's order, able to start at any sample of an epoch, for any world size.

    Each epoch is one global permutation seeded by (seed, epoch) (or the identity with
    shuffle=False). The position in an epoch is the number of samples of that permutation already
    consumed by all ranks together: after b batches of size B on W ranks, rank r has read
    order[r::W][:b*B], so together they read order[:b*B*W]. Iterating deals the rest,
    order[position:], over this run's ranks (rank r takes every world_size-th index, cut to a
    multiple of the world size so every rank has the same number of batches; DDP would hang
    otherwise). A resume with another world size or batch size therefore neither repeats nor skips
    data (at most world_size - 1 samples at an epoch's end are dropped, as DistributedSampler
    drops them). With the same world size it is exactly the batches the interrupted run would read.

    Bound to a `Progress` (as `run.loader` does), it reads the epoch and the position from it each
    time it is iterated; otherwise `start(epoch, sample)` sets them.
    """

    def __init__(
        self,
        num_samples: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        batch_size: int = 1,
        shuffle: bool = True,
        progress: Optional[Progress] = None,
    ) -> None:
        if num_samples < world_size:
            raise ValueError(f"{num_samples} training samples cannot be split over {world_size} workers")
        self.total = num_samples
        self.world_size, self.rank, self.batch_size, self.seed, self.shuffle = world_size, rank, batch_size, seed, shuffle
        self.progress = progress
        self._epoch, self._first = 0, 0

    @property
    def epoch(self) -> int:
        return self.progress.epoch if self.progress is not None else self._epoch

    @property
    def first_sample(self) -> int:
        return self.progress.sample_in_epoch if self.progress is not None else self._first

    def start(self, epoch: int, sample: int = 0) -> None:
        self._epoch, self._first = epoch, sample

    def _skips(self, epoch: int) -> List[Tuple[int, int]]:
        """(first sample, samples) of each range a rollback left out of `epoch`'s order, in order."""
        p = self.progress
        return [(s[1], s[2]) for s in p.skipped if s[0] == epoch and s[2]] if p is not None and p.skipped else []

    def _per_rank(self, first_sample: int) -> int:
        total = self.total - sum(n for _, n in self._skips(self.epoch))
        return max(0, total - first_sample) // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return -(-self._per_rank(0) // self.batch_size)

    @property
    def batches_left(self) -> int:
        """Batches left in the current epoch on each rank."""
        return -(-self._per_rank(self.first_sample) // self.batch_size)

    @property
    def samples_per_step(self) -> int:
        """Samples all ranks consume together in one full step."""
        return self.batch_size * self.world_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every rank's indices of `epoch` together, in order, without what rollbacks left out."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.total, generator=g)
        else:
            order = torch.arange(self.total)
        for first, n in self._skips(epoch):  # each range as it stood when it was skipped: after the ones before it
            order = torch.cat([order[:first], order[first + n :]])
        return order

    def order(self) -> torch.Tensor:
        """This rank's indices for the rest of the current epoch."""
        rest = self.epoch_order(self.epoch)[self.first_sample :]
        rest = rest[: len(rest) - len(rest) % self.world_size]
        return rest[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return self._per_rank(self.first_sample)


class TensorBatches:
    """Batches of in-memory tensors, fetched a batch at a time by index: what a DataLoader over a
    TensorDataset yields, without a `__getitem__` and a collate per sample."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        sampler: ResumableSampler,
        batch_size: int,
        drop_last: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.tensors, self.sampler, self.batch_size, self.drop_last = tuple(tensors), sampler, batch_size, drop_last
        self.pin_memory = pin_memory

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, ...]]:
        order = self.sampler.order()
        tensors, size, pin = self.tensors, self.batch_size, self.pin_memory
        stop = len(order) - len(order) % size if self.drop_last else len(order)
        for begin in range(0, stop, size):
            index = order[begin : begin + size]
            batch = tuple([t.index_select(0, index) for t in tensors])
            yield tuple([b.pin_memory() for b in batch]) if pin else batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    sampler: ResumableSampler,
    num_workers: int = 0,
    collate_fn: Optional[Callable[..., Any]] = None,
    drop_last: bool = False,
    pin_memory: bool = False,
    generator: Optional[torch.Generator] = None,
    **kwargs: Any,
) -> Any:
    """A loader over `dataset` in `sampler`'s order: TensorBatches for an in-memory TensorDataset
    read in this process, else a DataLoader (with its own generator, so it never draws on the
    global RNG: a resumed run must see the same random numbers as the uninterrupted one)."""
    if isinstance(dataset, TensorDataset) and num_workers == 0 and collate_fn is None and not kwargs:
        return TensorBatches(dataset.tensors, sampler, batch_size, drop_last=drop_last, pin_memory=pin_memory)
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=pin_memory,
        generator=generator,
        **kwargs,
    )


class Position:
    """Where the run's training data stands in the current epoch, from what its loader handed out
    (not from how often run.step was called): with gradient accumulation a step takes several
    batches, and a checkpoint must record every batch trained, or a resume trains some twice."""

    def __init__(self) -> None:
        self.active = False  # a tracked loader is in the middle of an epoch
        self.batches = 0  # batches of this epoch handed out, those before a resume included
        self.samples = 0  # samples of the epoch's order consumed by all ranks together
        self.last = 0  # how many batches this epoch has
        self.generation = 0  # one more at every rewind: a loader under way starts again from the progress
        self.at_end: Callable[[], bool] = _no  # a loader's batches are all handed out: True if that rewound

    def start(self, batch: int, sample: int, last: int) -> None:
        self.active, self.batches, self.samples, self.last = True, batch, sample, last

    def took(self, samples: int) -> None:
        self.batches += 1
        self.samples += samples

    def stop(self) -> None:
        self.active = False

    def completes_group(self, every: int) -> bool:
        """Whether the batch just handed out is the last of a group of `every` (or of the epoch)."""
        return not self.active or every <= 1 or self.batches % every == 0 or self.batches >= self.last


def _no() -> bool:
    return False


class Tracked:
    """A loader over a ResumableSampler whose batches are counted into a Position as they are handed
    out (anything else is the loader's: len(), its attributes). After a rewind (the batch just handed
    out was trained on a state rolled back) it starts again from where the progress now stands."""

    def __init__(self, loader: Any, sampler: ResumableSampler, batch_size: int, position: Position) -> None:
        self.loader, self.sampler, self.batch_size, self.position = loader, sampler, batch_size, position
        self._length: Optional[int] = None  # batches of the pass under way (the position moves as it goes)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from passes(self.position, self._pass)
        finally:
            self._length = None

    def _pass(self) -> Iterator[Any]:
        """The batches left in the epoch, from where the progress stands now."""
        sampler, size, position = self.sampler, self.batch_size, self.position
        per_rank = len(sampler)  # this rank's samples left in the epoch (the same on every rank)
        first = sampler.progress.batch_in_epoch if sampler.progress is not None else 0
        self._length = len(self.loader)
        position.start(first, sampler.first_sample, first + self._length)
        consumed, took, world = 0, position.took, sampler.world_size
        for batch in self.loader:
            taken = min(size, per_rank - consumed)
            consumed += taken
            took(taken * world)
            yield batch

    def __len__(self) -> int:
        """Batches of this pass over the epoch (from where the run stands when it begins)."""
        return self._length if self._length is not None else len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class RunData:
    """The run's data side: its samplers and loaders, their generators and the position in the epoch
    (Run's sampler, loader, batches, sync_gradients and step use it)."""

    def __init__(self, world_size: int, rank: int, seed: int, progress: Progress, accumulate: int) -> None:
        self.world_size, self.rank, self.seed, self.progress = world_size, rank, seed, progress
        self.accumulate = accumulate
        self.position = Position()
        self.samplers: List[ResumableSampler] = []
        self.generators: List[torch.Generator] = []
        self.samples_per_step = 0
        self.sources = Sources(progress, seed, rank, accumulate)  # a step loop's random batches and iterable data
        self.micro = 0  # batches entered through run.accumulate since the last step (a loop without run.loader)
        self.in_epoch = False  # run.epochs has begun an epoch and not ended it

    @property
    def batches_per_epoch(self) -> int:
        return self.samplers[0].batches_per_epoch if self.samplers else 0

    def sampler(self, dataset: Any, batch_size: int, shuffle: bool) -> ResumableSampler:
        sampler = ResumableSampler(len(dataset), self.world_size, self.rank, self.seed, batch_size, shuffle, self.progress)
        self.samplers.append(sampler)
        self.samples_per_step = sampler.samples_per_step
        return sampler

    def loader(self, dataset: Any, batch_size: int, shuffle: bool, **kwargs: Any) -> Any:
        sampler = self.sampler(dataset, batch_size, shuffle)
        generator = torch.Generator()  # a DataLoader never draws on the global RNG (exact resume)
        self.generators.append(generator)
        loader = make_loader(dataset, batch_size, sampler, generator=generator, **kwargs)
        return Tracked(loader, sampler, batch_size, self.position) if len(self.samplers) == 1 else loader

    def begin_epoch(self) -> None:
        self.in_epoch = True
        self._seed_generators()

    def _seed_generators(self) -> None:
        for generator in self.generators:
            generator.manual_seed(self.seed * 100_003 + self.progress.epoch)

    def skipping(self, loader: Iterable[Any]) -> Iterator[Any]:
        """A loader that is not the run's, its epoch set and the batches this epoch already trained
        skipped (and those a rollback left out: by their place in the loader's order). After a rewind
        it starts again from where the progress now stands."""
        return passes(self.position, lambda: self._foreign_pass(loader))

    def _foreign_pass(self, loader: Iterable[Any]) -> Iterator[Any]:
        p, position = self.progress, self.position
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(p.epoch)
        skip, left_out = p.batch_in_epoch, dropped(p.skipped, p.epoch)
        rng = torch.get_rng_state()
        batches = iter(loader)  # a DataLoader without its own generator draws its seed from the global RNG:
        torch.set_rng_state(rng)  # put it back, so a resumed run sees the same random numbers
        total = len(loader) if hasattr(loader, "__len__") else 0  # type: ignore[arg-type]
        position.start(skip, p.sample_in_epoch, total - len(left_out))
        kept = 0
        for i, batch in enumerate(batches):
            if i in left_out:
                continue
            kept += 1
            if kept > skip:
                position.took(self.samples_per_step)
                yield batch

    def indices(self, skipped: List[int]) -> Optional[List[int]]:
        """The dataset indices of a skip ([epoch, first sample, samples, ...]) in the run's first
        sampler's order, as it stands before that skip is recorded (None: no such sampler)."""
        epoch, first, samples = skipped[:3]
        if not self.samplers or not samples:
            return None
        return [int(i) for i in self.samplers[0].epoch_order(epoch)[first : first + samples].tolist()]

    def rewind(self) -> None:
        """The progress was moved back (a rollback): the loaders under way start again from it, and
        the loaders' generators are seeded as at the start of its epoch (a resume's are so)."""
        self.position.generation += 1
        self.position.stop()
        self._seed_generators()

    @property
    def counts_micro_batches(self) -> bool:
        """No loader of the run's is in the middle of an epoch: run.accumulate's entries are the batches."""
        return not self.position.active

    @property
    def sync_gradients(self) -> bool:
        if self.counts_micro_batches:
            return self.micro > 0 and self.micro % self.accumulate == 0
        return self.position.completes_group(self.accumulate)

    def entering_micro_batch(self) -> bool:
        """A loop without run.loader enters a batch's forward and backward: whether it completes a step."""
        self.micro += 1
        return self.micro % self.accumulate == 0

    def stepped(self) -> None:
        """An optimizer step is done: the progress takes the position of what was handed out."""
        p = self.progress
        self.micro = 0
        if self.sources.all:
            self.sources.stepped(p.global_step)
        if self.position.active:  # several batches a step with accumulation
            p.batch_in_epoch, p.sample_in_epoch = self.position.batches, self.position.samples
        else:
            p.batch_in_epoch += 1
            p.sample_in_epoch += self.samples_per_step

    def world_size_changed(
        self, record: Callable[..., None], step: Optional[int], saved: Optional[int], notes: Dict[str, Any]
    ) -> None:
        """Record a resume on another world size (a checkpoint of step `step` saved by `saved` ranks),
        once the loop has its data (the batch size) and the app has said what it does about it
        (`notes`: its policy). Nothing when the world size is the saved one, or there was no resume."""
        if step is None or saved in (None, self.world_size):
            return
        p, first = self.progress, self.samplers[0] if self.samplers else None
        batch = (
            {"batch_per_worker": first.batch_size, "global_batch": first.batch_size * self.world_size}
            if first is not None
            else {}
        )
        record(
            Event.WORLD_SIZE_CHANGED,
            step=step,
            saved_world_size=saved,
            world_size=self.world_size,
            epoch=p.epoch,
            sample_in_epoch=p.sample_in_epoch,
            **batch,
            **notes,
        )
        log.warning(
            "Resumed on %d worker(s) from a checkpoint of %d: the epoch continues at sample %d of its order, dealt over %d",
            self.world_size,
            saved,
            p.sample_in_epoch,
            self.world_size,
        )

    def end_epoch(self) -> None:
        p = self.progress
        p.epoch, p.batch_in_epoch, p.sample_in_epoch = p.epoch + 1, 0, 0
        self.position.stop()
        self.in_epoch = False


def passes(position: Position, one_pass: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """The batches of `one_pass()`, started again from the progress after a rewind (a rollback while a
    batch was out), and once more when the end of its batches rewound (the epoch's end agreed)."""
    while True:
        generation = position.generation
        for batch in one_pass():
            yield batch
            if position.generation != generation:
                break
        else:
            if not position.at_end():
                return


def dropped(skipped: List[List[int]], epoch: int) -> Set[int]:
    """The places in a loader's order of the batches rollbacks left out of `epoch` (each skip's first
    batch counted among the batches its epoch still had then: after the skips before it)."""
    out: Set[int] = set()
    for e, _, _, first, n in skipped:
        if e != epoch or not n:
            continue
        kept = -1
        place = 0
        while True:  # the place of the first batch: the first-th one not already left out
            if place not in out:
                kept += 1
                if kept == first:
                    break
            place += 1
        while n:
            if place not in out:
                out.add(place)
                n -= 1
            place += 1
    return out
