"""The FSDP2 baseline: a minimal hand-written FSDP2 training script, what a user writes without a framework.

    torchrun --standalone --nproc_per_node 2 bench/baseline_fsdp.py [--hidden 512,512] [--num-features 256] ...

Gloo, `fully_shard` (FSDP2) applied to every Linear layer of the MLP and then to the whole model
(what `parallel=fsdp` does to pipeline.models.MLP: its units are the blocks with parameters of its
Sequential), AdamW: the same model (pipeline.models.MLP), data (pipeline.data.synthetic, same seed
and split), batch size, learning rate and torch threads per worker as
`python -m pipeline.train data=synthetic parallel=fsdp trainer.optimizer=adamw ...`. Batches: each
epoch one permutation (seeded by the epoch), this rank's share of it, every batch indexed out of
the in-memory tensors (no DataLoader: the least a loop can do). Nothing else: no validation, no
checkpoints. Records as bench/baseline_ddp.py writes them (rank 0, JSON lines to --out:
"first_step", a row every --log-every steps after loss.item(), "done"), so bench.common reads both.
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
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

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
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--loader", choices=("slices",), default="slices")
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
    model = MLP(data.input_shape, data.output_size, [int(h) for h in args.hidden.split(",")], dropout=0.1)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
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
        for x, y in slices(epoch):
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
    dist.destroy_process_group()  # see the end of bench/baseline_ddp.py: an abort at exit is counted, not failed


if __name__ == "__main__":
    main()
