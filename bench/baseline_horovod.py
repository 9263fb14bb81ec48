"""The Horovod baseline: a minimal hand-written Horovod training script, what a user writes without a framework.

    horovodrun -np 2 python bench/baseline_horovod.py [--hidden 512,512] [--num-features 256] ...

hvd.init, the model and SGD with momentum, hvd.DistributedOptimizer (its defaults: an all-reduce per
gradient started by a hook during the backward pass, fused by Horovod's cycle), hvd.broadcast_parameters
and hvd.broadcast_optimizer_state from rank 0: the same model (pipeline.models.MLP), data
(pipeline.data.synthetic, same seed and split), batch size, learning rate and torch threads per worker
as `python -m pipeline.train data=synthetic backend=horovod ...`. Batches sliced from the in-memory
tensors (bench/baseline_loop.py, as `--loader slices` in bench/baseline_ddp.py). Nothing else: no
validation, no checkpoints. Records as bench/baseline_loop.py writes them.
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a file by horovodrun: its folder, bench/, would be sys.path[0], where bench/horovod.py hides the
# horovod package; the repository's root takes its place
sys.path[0] = str(Path(__file__).resolve().parents[1])
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from bench.baseline_loop import arguments, setup, slicer, train  # noqa: E402


def main() -> None:
    args = arguments()
    hvd.init()
    data, model = setup(args, hvd.local_size())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # hvd.DistributedOptimizer's zero_grad takes no arguments (it sets the gradients to None)
    train(args, hvd.rank(), model, optimizer, slicer(args, data, hvd.rank(), hvd.size()), zero_grad=optimizer.zero_grad)


if __name__ == "__main__":
    main()
