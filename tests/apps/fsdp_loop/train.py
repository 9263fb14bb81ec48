"""A user's own FSDP2 loop on steadfast (the tests copy this folder out of the repository and run
`python train.py`): fully_shard applied by the user to each block and to the whole model, AdamW,
run.loader, gradient accumulation written either way a user would write it, and every sample id
each rank trained written down, so a test can check that each sample of each epoch was trained once.

    accumulate: batches per optimizer step
    declared: true: the library is told (Run(accumulate_grad_batches=...), run.accumulate, run.sync_gradients);
              false: the loop counts batches itself and calls run.step after each optimizer.step
    optimizer_order: forward: AdamW over model.parameters(); blocks_reversed: over the same parameters,
              the blocks' in reverse order (what a code change can do: same shapes, other places)
"""

import json
import os

import hydra
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import steadfast as sf


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, features: int = 12, width: int = 30, blocks: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def dataset(size: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 12, generator=g)
    y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y, torch.arange(size))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    k = int(cfg.accumulate)
    with sf.Run(cfg, seed=cfg.seed, accumulate_grad_batches=k if cfg.declared else 1) as run:
        torch.manual_seed(cfg.seed)
        model = Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        params = list(model.parameters())
        if cfg.optimizer_order == "blocks_reversed":
            blocks = [p for block in reversed(model.blocks) for p in block.parameters()]
            params = [*model.inp.parameters(), *blocks, *model.out.parameters()]
        optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
        loader = run.loader(dataset(cfg.samples), batch_size=cfg.batch_size)
        run.resume(model=model, optimizer=optimizer)
        os.makedirs("samples", exist_ok=True)
        seen = open(f"samples/rank{run.rank}-of-{run.world_size}-pid{os.getpid()}.jsonl", "a")
        for epoch in run.epochs(cfg.epochs):
            ids = []
            for i, (x, y, idx) in enumerate(loader):
                ids += idx.tolist()
                if cfg.declared:
                    with run.accumulate(model):
                        (F.cross_entropy(model(x), y) / k).backward()
                    if not run.sync_gradients:
                        continue
                else:
                    loss = F.cross_entropy(model(x), y)
                    (loss / k).backward()
                    if (i + 1) % k and i + 1 < len(loader):
                        continue
                optimizer.step()
                optimizer.zero_grad()
                # what this step trained, written before run.step may commit it (a stop commits the step)
                seen.write(json.dumps({"epoch": epoch, "ids": ids}) + "\n")
                seen.flush()
                ids = []
                run.step()
        return run.finish()


if __name__ == "__main__":
    main()
