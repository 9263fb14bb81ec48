"""What a checkpoint holds besides the user's objects: the loop's progress and every rank's RNGs.

Anything with `state_dict()`/`load_state_dict()` is a `Stateful`: models, optimizers, LR
schedulers, GradScalers, torchdata's StatefulDataLoader, a user's own objects. Objects are saved
once, from rank 0 (they are the same on every rank after a step); `PerRank` marks an object whose
state differs between ranks (a data loader's position, a rank's own RNG): every rank's state is
gathered and each rank gets its own back.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class PerRank:
    """Marks a Stateful whose state differs between ranks: `run.resume(loader=PerRank(my_loader))`.
    (A torch DataLoader, torchdata's StatefulDataLoader included, is per rank without the mark.)"""

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> Any:
        return self.obj.load_state_dict(state)


def is_per_rank(obj: Any) -> bool:
    from torch.utils.data import DataLoader

    return isinstance(obj, (PerRank, DataLoader))


def unwrap(obj: Any) -> Any:
    """The module inside a DistributedDataParallel (or any `.module` wrapper of torch's)."""
    from torch.nn.parallel import DistributedDataParallel

    return obj.module if isinstance(obj, DistributedDataParallel) else obj


@dataclass
class Progress:
    """Where the loop stands: enough to continue at the next batch."""

    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches completed in the current epoch
    sample_in_epoch: int = 0  # samples of the epoch's order consumed by all ranks together (data.ResumableSampler)
    global_step: int = 0
    first_world_size: Optional[int] = None  # workers of the run's first launch (or the elastic job's full size)

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


class RNGState:
    """This rank's random number generators (torch, CUDA, numpy, python)."""

    def state_dict(self) -> Dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        np.random.set_state(tuple(state["numpy"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
