"""What the hand-written baselines share (bench/baseline_ddp.py, baseline_fsdp.py, baseline_horovod.py):
their flags, data, batches sliced from the in-memory tensors, the records the benchmarks read, and the
loop itself. Each baseline is still the loop a user writes; only its framework's lines differ.

Rank 0 appends JSON lines to --out: {"event": "first_step", "time": ...} after the first completed
step, then {"step", "epoch", "time"} every --log-every steps (after loss.item(), the usual print),
and {"event": "done", "time": ...}. Times are time.time(), comparable with the trainer's records.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from pipeline.data import synthetic
from pipeline.models import MLP


def arguments(loaders: Sequence[str] = ("slices",)) -> argparse.Namespace:
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
    p.add_argument("--loader", choices=tuple(loaders), default=loaders[0])
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def setup(args: argparse.Namespace, local_world: int) -> Tuple[Any, torch.nn.Module]:
    """Torch threads as the trainer sets them, the seed, the synthetic data and the (unwrapped) MLP."""
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local_world))
    torch.manual_seed(args.seed)
    data = synthetic(
        num_samples=args.num_samples,
        num_features=args.num_features,
        num_classes=args.num_classes,
        val_fraction=0.2,
        seed=args.seed,
    )
    return data, MLP(data.input_shape, data.output_size, [int(h) for h in args.hidden.split(",")], dropout=0.1)


def slicer(args: argparse.Namespace, data: Any, rank: int, world: int) -> Callable[[int], Iterator[Tuple[Any, Any]]]:
    """Each epoch one permutation (seeded by the epoch), this rank's share of it, every batch indexed
    out of the in-memory tensors: the least a loop can do."""
    features, labels = data.train.tensors

    def slices(epoch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator()
        g.manual_seed(args.seed + epoch)
        order = torch.randperm(len(features), generator=g)
        order = order[: len(order) - len(order) % world][rank::world]
        for begin in range(0, len(order), args.batch_size):
            index = order[begin : begin + args.batch_size]
            yield features[index], labels[index]

    return slices


def train(
    args: argparse.Namespace,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], Iterable[Tuple[Any, Any]]],
    zero_grad: Optional[Callable[[], None]] = None,
) -> None:
    """The loop: zero_grad, forward, backward, step; rank 0 writes the records."""
    out = open(args.out, "a") if rank == 0 else None

    def record(**row: object) -> None:
        if out is not None:
            out.write(json.dumps({"time": time.time(), **row}) + "\n")
            out.flush()

    clear = zero_grad or (lambda: optimizer.zero_grad(set_to_none=True))
    step = 0
    for epoch in range(args.epochs):
        for x, y in batches(epoch):
            clear()
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
