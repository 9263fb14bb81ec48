"""What a checkpoint holds besides the user's objects: the loop's progress and every rank's RNGs.

Anything with `state_dict()`/`load_state_dict()` is a `Stateful`: models, optimizers, LR
schedulers, GradScalers, torchdata's StatefulDataLoader, a user's own objects. Objects are saved
once, from rank 0 (they are the same on every rank after a step); `PerRank` marks an object whose
state differs between ranks (a data loader's position, a rank's own RNG): every rank's state is
gathered and each rank gets its own back. `model_sha256` is the digest of a model's state, what
a run ends with in summary.json (an exact resume ends with the same one as a run never stopped).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn


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
    # batches the steps took from each of the run's step-loop sources (run.random_batches, run.stream), in order
    streams: List[int] = field(default_factory=list)
    # what rollbacks left out of the data (steadfast/health/): [epoch, first sample, samples, first batch,
    # batches] in that epoch's order as it stood then, in the order they were skipped (data.ResumableSampler)
    skipped: List[List[int]] = field(default_factory=list)
    rollbacks: List[int] = field(default_factory=list)  # the step of each anomaly rolled back, oldest first
    diverged: List[int] = field(default_factory=list)  # each rank named diverged from the others, once per finding

    def state_dict(self) -> Dict[str, Any]:
        state = asdict(self)
        if not self.streams:  # a run without such sources saves what it always saved
            del state["streams"]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Checked whole before anything is set: ValueError names the first key that is wrong (an
        unknown key, a count that is not a non-negative int, a world size that is not positive);
        a key the state does not have keeps its value (a checkpoint of an older version)."""
        self.check_state(state)
        for key, value in state.items():
            setattr(self, key, list(value) if key == "streams" else value)

    def check_state(self, state: Any) -> None:
        """ValueError when `state` cannot be loaded (a resume asks before it applies anything)."""
        if not isinstance(state, dict):
            raise ValueError(f"progress: the state must be a dict, not a {type(state).__name__}")
        for key, value in state.items():
            if key in COUNTS:
                if not _int_in(value, 0, MAX_COUNT):
                    raise ValueError(f"progress {key!r}: must be an int from 0 to {MAX_COUNT}, not {_show(value)}")
            elif key == "streams":
                if not (isinstance(value, list) and len(value) <= MAX_STREAMS and all(_int_in(v, 0, MAX_COUNT) for v in value)):
                    raise ValueError(f"progress 'streams': must be a list of at most {MAX_STREAMS} ints from 0 to {MAX_COUNT}")
            elif key == "first_world_size":
                if value is not None and not _int_in(value, 1, MAX_WORLD_SIZE):
                    raise ValueError(f"progress {key!r}: must be None or an int from 1 to {MAX_WORLD_SIZE}, not {_show(value)}")
            elif key in HISTORY:
                width = 5 if key == "skipped" else None
                if not _int_list(value, width):
                    shape = f"lists of {width} ints" if width else "ints"
                    raise ValueError(f"progress {key!r}: must be a list of at most {MAX_HISTORY} {shape} from 0 to {MAX_COUNT}")
            else:
                raise ValueError(f"progress: unknown key {_show(key)}")


class RNGState:
    """This rank's random number generators (torch, CUDA, numpy, python)."""

    def state_dict(self) -> Dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def check_state(self, state: Any) -> None:
        """ValueError when `state` cannot be loaded (a resume asks before it applies anything)."""
        _checked_rng(state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Every generator's state is checked (types, sizes, ranges) before any is set; ValueError
        names the one that is wrong, and leaves all of them as they were."""
        checked = _checked_rng(state)
        before = self.state_dict()
        try:
            _set_rng(checked)
        except Exception as exc:  # what the checks above did not foresee: put every generator back
            _set_rng(before)
            raise ValueError(f"rng state: {type(exc).__name__}: {exc}") from None


COUNTS = ("epoch", "batch_in_epoch", "sample_in_epoch", "global_step")
HISTORY = ("skipped", "rollbacks", "diverged")
MAX_HISTORY = 100_000  # entries of each history list: far beyond what max_rollbacks lets a run reach
MAX_COUNT = 2**53  # far beyond any run; well below what a manifest accepts (10**18 steps), so saves after it stay valid
MAX_WORLD_SIZE = 2**31
MAX_STREAMS = 1024
MT_WORDS = 624  # numpy's MT19937 key


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _int_list(value: Any, width: Optional[int]) -> bool:
    """A list of at most MAX_HISTORY counts, or (`width`) of lists of `width` counts."""
    if not isinstance(value, list) or len(value) > MAX_HISTORY:
        return False
    if width is None:
        return all(_int_in(v, 0, MAX_COUNT) for v in value)
    return all(isinstance(v, list) and len(v) == width and all(_int_in(x, 0, MAX_COUNT) for x in v) for v in value)


def _show(value: Any) -> str:
    return repr(value)[:60] if isinstance(value, (int, float, str, type(None))) else f"a {type(value).__name__}"


def _bytes_like(value: Any, what: str, size: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1 or value.numel() != size:
        got = f"{value.dtype} of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else _show(value)
        raise ValueError(f"rng state {what!r}: must be a uint8 tensor of {size} bytes, not {got}")
    return value


def _checked_rng(state: Any) -> Dict[str, Any]:
    """The generators' states in the form their setters take, or ValueError naming what is wrong."""
    if not isinstance(state, dict) or set(state) != {"torch", "cuda", "numpy", "python"}:
        keys = sorted(map(str, state)) if isinstance(state, dict) else _show(state)
        raise ValueError(f"rng state: must be a dict of torch, cuda, numpy and python; got {keys}")
    out: Dict[str, Any] = {"torch": _bytes_like(state["torch"], "torch", torch.get_rng_state().numel())}
    cuda = state["cuda"]
    if not isinstance(cuda, (list, tuple)):
        raise ValueError(f"rng state 'cuda': must be a list of tensors, not {_show(cuda)}")
    out["cuda"] = list(cuda)
    if torch.cuda.is_available() and cuda:
        if len(cuda) > torch.cuda.device_count():
            raise ValueError(f"rng state 'cuda': {len(cuda)} devices, this process sees {torch.cuda.device_count()}")
        for i, one in enumerate(cuda):
            _bytes_like(one, f"cuda {i}", torch.cuda.get_rng_state(i).numel())
    numpy = state["numpy"]
    if not (isinstance(numpy, (list, tuple)) and len(numpy) == 5):
        raise ValueError(f"rng state 'numpy': must be numpy's 5-tuple, not {_show(numpy)}")
    name, keys, pos, has_gauss, cached = numpy
    if (
        name != "MT19937"
        or not isinstance(keys, np.ndarray)
        or keys.shape != (MT_WORDS,)
        or keys.dtype != np.uint32
        or not _int_in(pos, 0, MT_WORDS)
        or not _int_in(has_gauss, 0, 1)
        or not isinstance(cached, (int, float))
        or isinstance(cached, bool)
    ):
        raise ValueError(f"rng state 'numpy': not an MT19937 state ({MT_WORDS} uint32 words, position, gauss)")
    out["numpy"] = (name, keys, pos, has_gauss, float(cached))
    python = state["python"]
    if not (isinstance(python, (list, tuple)) and len(python) == 3):
        raise ValueError(f"rng state 'python': must be random.getstate()'s 3-tuple, not {_show(python)}")
    version, internal, gauss = python
    if (
        version != 3
        or not isinstance(internal, (list, tuple))
        or len(internal) != MT_WORDS + 1
        or not all(_int_in(w, 0, 2**32 - 1) for w in internal)
        or not 0 <= internal[-1] <= MT_WORDS
        or not (gauss is None or isinstance(gauss, float))
    ):
        raise ValueError(f"rng state 'python': not a version 3 Mersenne Twister state ({MT_WORDS + 1} words, gauss)")
    out["python"] = (3, tuple(internal), gauss)
    return out


def _set_rng(state: Dict[str, Any]) -> None:
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


def model_sha256(model: nn.Module) -> str:
    """sha256 over every tensor of the state_dict, in key order, as contiguous CPU bytes. A sharded
    tensor (FSDP2's DTensor) is gathered whole first, a tensor at a time: collective, and the same
    digest as the unsharded model's."""
    from .shards import is_dtensor

    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
        t = whole.detach().cpu().contiguous().reshape(-1)
        if t.numel():
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
