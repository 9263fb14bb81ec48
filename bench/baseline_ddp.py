"""The baseline: a minimal hand-written DDP training script, the kind users write before a framework.

    torchrun --standalone --nproc_per_node 2 bench/baseline_ddp.py [--hidden 512,512] [--num-features 256] [--loader slices] ...

Gloo, DistributedDataParallel, SGD with momentum: the same model (pipeline.models.MLP), the same
data (pipeline.data.synthetic, same seed and split), batch size and torch threads per worker as
`python -m pipeline.train data=synthetic ...`. Nothing else: no validation, no checkpoints, no
records besides what the benchmark reads. Batches (--loader):
  dataloader  DistributedSampler + DataLoader over the TensorDataset (the usual script)
  slices      no DataLoader: each epoch one permutation (seeded by the epoch), this rank's share of
              it, and every batch indexed out of the in-memory tensors (the least a loop can do)

Rank 0 appends JSON lines to --out: {"event": "first_step", "time": ...} after the first completed
step, then {"step", "epoch", "time"} every --log-every steps (after loss.item(), the usual print),
and {"event": "done", "time": ...}. Times are time.time(), comparable with the trainer's records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file by torchrun
from pipeline.data import synthetic  # noqa: E402  (numpy only)
from pipeline.models import MLP  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-samples", type=int, default=2048)
    p.add_argument("--num-features", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=4)
    p.add_argument("--hidden", default="64,64")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default: cores / workers, as the trainer)"
    )
    p.add_argument("--loader", choices=("dataloader", "slices"), default="dataloader")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local_world))  # as the trainer
    torch.manual_seed(args.seed)

    data = synthetic(
        num_samples=args.num_samples,
        num_features=args.num_features,
        num_classes=args.num_classes,
        val_fraction=0.2,
        seed=args.seed,
    )
    model = DDP(MLP(data.input_shape, data.output_size, [int(h) for h in args.hidden.split(",")], dropout=0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
    sampler: DistributedSampler[int] = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler)
    features, labels = data.train.tensors

    def slices(epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator()
        g.manual_seed(args.seed + epoch)
        order = torch.randperm(len(features), generator=g)
        order = order[: len(order) - len(order) % world][rank::world]
        for begin in range(0, len(order), args.batch_size):
            index = order[begin : begin + args.batch_size]
            yield features[index], labels[index]

    out = open(args.out, "a") if rank == 0 else None

    def record(**row: object) -> None:
        if out is not None:
            out.write(json.dumps({"time": time.time(), **row}) + "\n")
            out.flush()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader if args.loader == "dataloader" else slices(epoch):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                record(event="first_step", step=step)
            if step % args.log_every == 0:
                loss_value = loss.item()
                record(step=step, epoch=epoch, loss=round(loss_value, 6))
    record(event="done", step=step)
    # About 1 run in 5 here aborts after this, at interpreter exit ("terminate called without an
    # active exception", torch 2.13 + Gloo, with or without this call): torchrun then reports a
    # failed job. The benchmark counts such a run as finished (its "done" record is written) and
    # reports how often it happened.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
