"""A user's own loop on steadfast that hands run.step its loss and its gradient norm (the tests copy
this folder out of the repository and run `python train.py`): DDP through run.setup, run.loader
(or, `loader=sampler`, the loop's own DataLoader over run.sampler), clip_grad_norm_'s norm given to
the anomaly watch, and every sample id each rank trained written down at each step, so a test can
tell which samples a rollback skipped."""

import json
import os

import hydra
import torch
import torch.nn.functional as F
from torch import nn

import steadfast as sf


def dataset(size: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 12, generator=g)
    y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y, torch.arange(size))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=cfg.seed, stop_check_every_n_steps=cfg.check_every) as run:
        torch.manual_seed(cfg.seed)
        net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))
        model, optimizer = run.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
        data = dataset(cfg.samples)
        if cfg.loader == "run":
            loader = run.loader(data, batch_size=cfg.batch_size)
        else:
            loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, sampler=run.sampler(data, cfg.batch_size))
        run.resume(model=model, optimizer=optimizer)
        os.makedirs("samples", exist_ok=True)
        seen = open(f"samples/rank{run.rank}-pid{os.getpid()}.jsonl", "a")
        for epoch in run.epochs(cfg.epochs):
            for x, y, idx in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                optimizer.step()
                optimizer.zero_grad()
                seen.write(json.dumps({"step": run.global_step + 1, "epoch": epoch, "ids": idx.tolist()}) + "\n")
                seen.flush()
                run.step(loss, grad_norm=norm)
        return run.finish()


if __name__ == "__main__":
    main()
