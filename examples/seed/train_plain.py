"""A user's training script, run by torchrun (examples/seed: train.py is the same script on steadfast).

torchrun --nproc_per_node=2 --max_restarts=3 --monitor_interval=30 examples/seed/train_plain.py
"""

import glob
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

EPOCHS = 30
CHECKPOINT_DIR = "checkpoints"


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


class CheckpointManager:
    def __init__(self, folder):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def save(self, model, optimizer, epoch, loss):
        path = os.path.join(self.folder, f"epoch_{epoch:04d}.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "loss": loss}, path)

    def load_latest(self, model, optimizer):
        files = sorted(glob.glob(os.path.join(self.folder, "epoch_*.pt")))
        if not files:
            return 0
        state = torch.load(files[-1])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"] + 1


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dataset = RandomDataset()
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    checkpoints = CheckpointManager(CHECKPOINT_DIR)
    start = checkpoints.load_latest(model.module, optimizer)
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1}/{EPOCHS} loss {loss.item():.4f}")
            if (epoch + 1) % 10 == 0:
                checkpoints.save(model.module, optimizer, epoch, loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
