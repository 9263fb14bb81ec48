"""The baseline: a minimal hand-written DDP training script, the kind users write before a framework.

    torchrun --standalone --nproc_per_node 2 bench/baseline_ddp.py [--hidden 512,512] [--num-features 256] [--loader slices] ...

Gloo, DistributedDataParallel, SGD with momentum: the same model (pipeline.models.MLP), the same
data (pipeline.data.synthetic, same seed and split), batch size and torch threads per worker as
`python -m pipeline.train data=synthetic ...`. Nothing else: no validation, no checkpoints, no
records besides what the benchmark reads. Batches (--loader):
  dataloader  DistributedSampler + DataLoader over the TensorDataset (the usual script)
  slices      no DataLoader: each epoch one permutation (seeded by the epoch), this rank's share of
              it, and every batch indexed out of the in-memory tensors (the least a loop can do)

Rank 0 appends the records bench/baseline_loop.py writes (first step, a row every --log-every
steps after loss.item(), done), which bench.common reads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterable, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file by torchrun
from bench.baseline_loop import arguments, setup, slicer, train  # noqa: E402


def main() -> None:
    args = arguments(loaders=("dataloader", "slices"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, mlp = setup(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    model = DDP(mlp)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
    sampler: DistributedSampler[int] = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler)
    slices = slicer(args, data, rank, world)

    def batches(epoch: int) -> Iterable[Tuple[Any, Any]]:
        if args.loader == "slices":
            return slices(epoch)
        sampler.set_epoch(epoch)
        return loader

    train(args, rank, model, optimizer, batches)
    # About 1 run in 5 here aborts after this, at interpreter exit ("terminate called without an
    # active exception", torch 2.13 + Gloo, with or without this call): torchrun then reports a
    # failed job. The benchmark counts such a run as finished (its "done" record is written) and
    # reports how often it happened.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
