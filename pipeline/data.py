"""Built-in datasets (the sampler that resumes mid-epoch is steadfast.ResumableSampler, steadfast/loop/data.py)."""

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
    input_shape: Tuple[int, ...]  # one sample's
    output_size: int  # what the model produces per sample (or per position): classes, targets, vocabulary


def _split(
    x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int, input_shape: Tuple[int, ...], output_size: int
) -> Datasets:
    order = np.random.RandomState(seed).permutation(len(x))
    n_val = max(1, int(round(len(x) * val_fraction)))
    val, train = order[:n_val], order[n_val:]
    tx = torch.from_numpy(x.astype(np.float32))
    ty = torch.from_numpy(y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32))
    return Datasets(TensorDataset(tx[train], ty[train]), TensorDataset(tx[val], ty[val]), input_shape, output_size)


def digits(val_fraction: float = 0.2, seed: int = 0, **_: Any) -> Datasets:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), scaled to [0, 1]."""
    # Read scikit-learn's bundled CSV directly: importing sklearn costs every worker about a second.
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("data=digits reads scikit-learn's bundled digits: pip install 'steadfast[trainer]' (or scikit-learn)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    x = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    return _split(x, table[:, -1].astype(np.int64), val_fraction, seed, (1, 8, 8), 10)


def synthetic(
    num_samples: int = 2048, num_features: int = 32, num_classes: int = 4, val_fraction: float = 0.2, seed: int = 0, **_: Any
) -> Datasets:
    """Gaussian clusters around random class centres: learnable, generated from a fixed seed."""
    rng = np.random.RandomState(seed)
    centres = rng.normal(0.0, 0.3, size=(num_classes, num_features))
    y = rng.randint(0, num_classes, size=num_samples)
    x = centres[y] + rng.normal(0.0, 1.0, size=(num_samples, num_features))
    return _split(x, y, val_fraction, seed, (num_features,), num_classes)


def synthetic_regression(
    num_samples: int = 2048,
    num_features: int = 16,
    num_targets: int = 1,
    hidden: int = 8,
    noise: float = 0.1,
    val_fraction: float = 0.2,
    seed: int = 0,
    **_: Any,
) -> Datasets:
    """Real-valued targets from a fixed random function of the features, y = tanh(x A) B + noise:
    nonlinear, learnable, generated from a fixed seed."""
    rng = np.random.RandomState(seed)
    a = rng.normal(0.0, 1.0 / np.sqrt(num_features), size=(num_features, hidden))
    b = rng.normal(0.0, 1.0, size=(hidden, num_targets))
    x = rng.normal(0.0, 1.0, size=(num_samples, num_features))
    y = np.tanh(x @ a) @ b + rng.normal(0.0, noise, size=(num_samples, num_targets))
    return _split(x, y, val_fraction, seed, (num_features,), num_targets)


def text(
    block_size: int = 128, stride: int | None = None, max_chars: int = 1_000_000, val_fraction: float = 0.1, **_: Any
) -> Datasets:
    """Character windows of the Python standard library's own sources (pipeline/text.py): inputs
    and next-character targets, `block_size` long, a window every `stride` characters (default:
    block_size, no overlap); the last `val_fraction` of the text is the validation set."""
    from .text import load_corpus, split

    corpus = load_corpus(max_chars)
    train, val = split(corpus, block_size, stride or block_size, val_fraction)
    return Datasets(train, val, (block_size,), corpus.vocab_size)


DATASETS: Dict[str, Callable[..., Datasets]] = {
    "digits": digits,
    "synthetic": synthetic,
    "synthetic_regression": synthetic_regression,
    "text": text,
}
LOADER_KEYS = ("batch_size", "num_workers")


def build_data(cfg: Any) -> Datasets:
    from .registry import resolve

    builder, kwargs = resolve(cfg, DATASETS, "data")
    for key in LOADER_KEYS:
        kwargs.pop(key, None)
    return builder(**kwargs)
