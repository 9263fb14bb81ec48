"""Built-in datasets and the sampler that lets a run resume mid-epoch with the same data order."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, TensorDataset


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    input_shape: Tuple[int, ...]
    num_classes: int


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int, input_shape: Tuple[int, ...]) -> Datasets:
    order = np.random.RandomState(seed).permutation(len(x))
    n_val = max(1, int(round(len(x) * val_fraction)))
    val, train = order[:n_val], order[n_val:]
    tx, ty = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    return Datasets(TensorDataset(tx[train], ty[train]), TensorDataset(tx[val], ty[val]), input_shape, int(y.max()) + 1)


def digits(val_fraction: float = 0.2, seed: int = 0, **_: Any) -> Datasets:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), scaled to [0, 1]."""
    # Read scikit-learn's bundled CSV directly: importing sklearn costs every worker about a second.
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("data=digits reads scikit-learn's bundled digits: pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    x = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    return _split(x, table[:, -1].astype(np.int64), val_fraction, seed, (1, 8, 8))


def synthetic(num_samples: int = 2048, num_features: int = 32, num_classes: int = 4, val_fraction: float = 0.2, seed: int = 0, **_: Any) -> Datasets:
    """Gaussian clusters around random class centres: learnable, generated from a fixed seed."""
    rng = np.random.RandomState(seed)
    centres = rng.normal(0.0, 0.3, size=(num_classes, num_features))
    y = rng.randint(0, num_classes, size=num_samples)
    x = centres[y] + rng.normal(0.0, 1.0, size=(num_samples, num_features))
    return _split(x, y, val_fraction, seed, (num_features,))


DATASETS: Dict[str, Callable[..., Datasets]] = {"digits": digits, "synthetic": synthetic}
LOADER_KEYS = ("batch_size", "num_workers")


def build_data(cfg: Any) -> Datasets:
    from .registry import resolve

    builder, kwargs = resolve(cfg, DATASETS, "data")
    for key in LOADER_KEYS:
        kwargs.pop(key, None)
    return builder(**kwargs)


class ResumableSampler(Sampler[int]):
    """DistributedSampler's order, able to start at any sample of an epoch, for any world size.

    Each epoch is one global permutation seeded by (seed, epoch). The position in an epoch is the
    number of samples of that permutation already consumed by all ranks together: after b batches
    of size B on W ranks, rank r has read order[r::W][:b*B], so together they read order[:b*B*W].
    `start(epoch, sample)` deals the rest, order[sample:], over this run's ranks (rank r takes every
    world_size-th index, cut to a multiple of the world size so every rank has the same number of
    batches; DDP would hang otherwise). A resume with another world size or batch size therefore
    neither repeats nor skips data (at most world_size - 1 samples at an epoch's end are dropped,
    as DistributedSampler drops them). With the same world size it is exactly the batches the
    interrupted run would have read.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, batch_size: int, seed: int) -> None:
        self.total = num_samples
        self.world_size, self.rank, self.batch_size, self.seed = world_size, rank, batch_size, seed
        self.epoch, self.first_sample = 0, 0
        if num_samples - num_samples % world_size == 0:
            raise ValueError(f"{num_samples} training samples cannot be split over {world_size} workers")

    def _per_rank(self, first_sample: int) -> int:
        left = max(0, self.total - first_sample)
        return left // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return -(-self._per_rank(0) // self.batch_size)

    @property
    def batches_left(self) -> int:
        return -(-self._per_rank(self.first_sample) // self.batch_size)

    @property
    def samples_per_step(self) -> int:
        """Samples all ranks consume together in one full step."""
        return self.batch_size * self.world_size

    def start(self, epoch: int, sample: int = 0) -> None:
        self.epoch, self.first_sample = epoch, sample

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed * 100_003 + self.epoch)
        rest = torch.randperm(self.total, generator=g)[self.first_sample :]
        rest = rest[: len(rest) - len(rest) % self.world_size]
        return iter(rest[self.rank :: self.world_size].tolist())

    def __len__(self) -> int:
        return self._per_rank(self.first_sample)
