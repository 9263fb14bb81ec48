"""The FSDP2 baseline: a minimal hand-written FSDP2 training script, what a user writes without a framework.

    torchrun --standalone --nproc_per_node 2 bench/baseline_fsdp.py [--hidden 512,512] [--num-features 256] ...

Gloo, `fully_shard` (FSDP2) applied to every Linear layer of the MLP and then to the whole model
(what `parallel=fsdp` does to pipeline.models.MLP: its units are the blocks with parameters of its
Sequential), AdamW: the same model (pipeline.models.MLP), data (pipeline.data.synthetic, same seed
and split), batch size, learning rate and torch threads per worker as
`python -m pipeline.train data=synthetic parallel=fsdp trainer.optimizer=adamw ...`. Batches: each
epoch one permutation (seeded by the epoch), this rank's share of it, every batch indexed out of
the in-memory tensors (no DataLoader: the least a loop can do). Nothing else: no validation, no
checkpoints. Records as bench/baseline_loop.py writes them, so bench.common reads every baseline's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file by torchrun
from bench.baseline_loop import arguments, setup, slicer, train  # noqa: E402


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, model = setup(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    train(args, rank, model, optimizer, slicer(args, data, rank, world))
    dist.destroy_process_group()  # see the end of bench/baseline_ddp.py: an abort at exit is counted, not failed


if __name__ == "__main__":
    main()
