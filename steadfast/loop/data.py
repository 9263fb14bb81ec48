"""Data that resumes exactly: a sampler that can start anywhere in an epoch, for any world size.

`run.loader(dataset, batch_size)` (steadfast.Run) gives each rank its shard of one global
permutation per epoch, positioned where the run stands; in-memory tensor datasets are fetched a
batch at a time by index (no per-sample `__getitem__` and collate).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

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

    def _per_rank(self, first_sample: int) -> int:
        return max(0, self.total - first_sample) // self.world_size

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

    def order(self) -> torch.Tensor:
        """This rank's indices for the rest of the current epoch."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed * 100_003 + self.epoch)
            rest = torch.randperm(self.total, generator=g)[self.first_sample :]
        else:
            rest = torch.arange(self.first_sample, self.total)
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


class Tracked:
    """A loader over a ResumableSampler whose batches are counted into a Position as they are handed
    out (anything else is the loader's: len(), its attributes)."""

    def __init__(self, loader: Any, sampler: ResumableSampler, batch_size: int, position: Position) -> None:
        self.loader, self.sampler, self.batch_size, self.position = loader, sampler, batch_size, position
        self._length: Optional[int] = None  # batches of the pass under way (the position moves as it goes)

    def __iter__(self) -> Iterator[Any]:
        sampler, size = self.sampler, self.batch_size
        per_rank = len(sampler)  # this rank's samples left in the epoch (the same on every rank)
        first = sampler.progress.batch_in_epoch if sampler.progress is not None else 0
        self._length = len(self.loader)
        self.position.start(first, sampler.first_sample, first + self._length)
        consumed, took, world = 0, self.position.took, sampler.world_size
        try:
            for batch in self.loader:
                taken = min(size, per_rank - consumed)
                consumed += taken
                took(taken * world)
                yield batch
        finally:
            self._length = None

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
        for generator in self.generators:
            generator.manual_seed(self.seed * 100_003 + self.progress.epoch)

    def skipping(self, loader: Iterable[Any]) -> Iterator[Any]:
        """A loader that is not the run's, its epoch set and the batches this epoch already trained skipped."""
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.progress.epoch)
        skip = self.progress.batch_in_epoch
        rng = torch.get_rng_state()
        batches = iter(loader)  # a DataLoader without its own generator draws its seed from the global RNG:
        torch.set_rng_state(rng)  # put it back, so a resumed run sees the same random numbers
        total = len(loader) if hasattr(loader, "__len__") else 0  # type: ignore[arg-type]
        self.position.start(skip, self.progress.sample_in_epoch, total)
        for i, batch in enumerate(batches):
            if i >= skip:
                self.position.took(self.samples_per_step)
                yield batch

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
