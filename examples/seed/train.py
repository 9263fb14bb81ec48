"""A user's training script, run by steadfast (examples/seed: train_plain.py is the script before).

python -m examples.seed.train
"""

import hydra
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import steadfast as sf


class Net(nn.Module):
    def __init__(self, features=20, hidden=64, classes=4):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.layers(x)


class RandomDataset(Dataset):
    """Random features (a fixed seed) and labels from a hidden linear rule."""

    def __init__(self, size=4096, features=20, classes=4):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, features, generator=g)
        self.y = (self.x @ torch.randn(features, classes, generator=g)).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    run = sf.Run(cfg, seed=cfg.seed)  # seeds the data order (the sampler's permutation), not the weights
    rank = run.rank
    torch.manual_seed(cfg.seed)  # the weights: the same initial model on every rank
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = run.setup(model, optimizer)
    dataset = RandomDataset()
    loader = run.loader(dataset, batch_size=32)
    run.resume(model=model, optimizer=optimizer)
    for epoch in run.epochs(cfg.epochs):
        for x, y in loader:
            x, y = x.to(run.device), y.to(run.device)  # the GPU run.setup chose, if there is one
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            run.step(loss)
        loss = run.epoch_loss()  # the epoch's mean over every rank: None if a resume found it already done
        if rank == 0 and loss is not None:
            print(f"epoch {epoch + 1}/{cfg.epochs} loss {loss:.4f}")
    run.finish()


if __name__ == "__main__":
    main()
