"""How `run.setup` spreads a model over the ranks: `parallel=ddp` (the backend's data parallelism),
`parallel=fsdp` (FSDP2's fully_shard: parameters, gradients and optimizer state sharded), `none`.

FSDP2 replaces a module's parameters with sharded ones (DTensors), so an optimizer built before
`run.setup` would hold the old ones: setup points it at the new ones, by parameter name (the
optimizer must not have stepped yet). Checkpoints and snapshots of sharded state are sharded too
(steadfast/checkpoint/sharded.py): each rank writes only its own pieces.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from ..config import ParallelConf
from .comm import Comm

log = logging.getLogger(__name__)


def units(model: nn.Module, names: List[str]) -> List[nn.Module]:
    """The submodules that become FSDP units: those of the classes named, or (none named) the blocks
    of the model's first ModuleList or Sequential of several blocks with parameters (a transformer's layers)."""
    if names:
        wanted = set(names)
        found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        missing = wanted - {type(m).__name__ for m in found}
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"parallel.units={sorted(wanted)}: the model has no {sorted(missing)}; its module classes are {present}"
            )
        return found
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks = [m for m in module.children() if any(True for _ in m.parameters())]
            if len(blocks) >= 2:
                return blocks
    return []


def shard(model: nn.Module, conf: ParallelConf, optimizer: Optional[torch.optim.Optimizer]) -> nn.Module:
    """fully_shard each unit, then the whole model; `optimizer` is pointed at the sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if optimizer is not None and optimizer.state:
        raise RuntimeError("run.setup with parallel=fsdp: the optimizer has already stepped; build it before training")
    before: Dict[int, str] = {id(p): name for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, conf.param_dtype.value) if conf.param_dtype else None,
        reduce_dtype=getattr(torch, conf.reduce_dtype.value) if conf.reduce_dtype else None,
    )
    chosen = units(model, conf.units)
    for unit in chosen:
        fully_shard(unit, reshard_after_forward=conf.reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=conf.reshard_after_forward, mp_policy=policy)
    log.info(
        "FSDP2: %d unit(s) (%s) and the whole model, sharded over the ranks",
        len(chosen),
        sorted({type(u).__name__ for u in chosen}),
    )
    if optimizer is not None:
        after = dict(model.named_parameters())
        for group in optimizer.param_groups:
            try:
                group["params"] = [after[before[id(p)]] for p in group["params"]]
            except KeyError:
                raise RuntimeError(
                    "run.setup with parallel=fsdp: the optimizer holds parameters that are not the model's"
                ) from None
    return model


def setup(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], conf: ParallelConf, comm: Comm, accumulate: int) -> Any:
    """The model (wrapped or sharded as `conf` says) and the optimizer to train with (`accumulate`:
    batches per optimizer step, for an optimizer that reduces gradients itself: Horovod's)."""
    kind = conf.kind.value
    if kind == "fsdp":
        return shard(model, conf, optimizer), optimizer
    if kind == "none":
        return model, optimizer
    wrapped = comm.wrap_model(model)
    return wrapped, (comm.wrap_optimizer(optimizer, model, accumulate) if optimizer is not None else None)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradients of the backward passes inside accumulate on each rank without being reduced: DDP's
    no_sync, FSDP2's set_requires_gradient_sync(False); a model reduced elsewhere (Horovod's
    optimizer counts backward passes itself) is left alone."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
