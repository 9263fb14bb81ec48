"""Built-in datasets (the sampler that resumes mid-epoch is steadfast.data.ResumableSampler)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


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
