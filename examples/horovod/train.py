"""A Horovod app (written with Horovod's own calls) on steadfast: run from the repository root,

    python -m examples.horovod.train                # 2 Horovod workers (horovod.run over Gloo)

Everything hvd.* is the app's: hvd.DistributedOptimizer averages the gradients,
hvd.broadcast_parameters and hvd.broadcast_optimizer_state make every rank start from rank 0's
state, hvd.allreduce averages the metrics, and the data is sharded by hvd.rank()/hvd.size(). What
steadfast adds: the launcher (conf/config.yaml selects backend: horovod; Horovod's runner starts the
workers, a failed job is relaunched from its newest checkpoint), `run.resume` (the newest checkpoint
that verifies, the data position and every rank's RNGs), `run.step` (checkpoint cadence, preemption,
hang watchdog, metrics) and the run's records. A killed run ends with the uninterrupted run's weights.

`sf.Run` initialises Horovod (hvd.init) and pins the rank's GPU; `run.setup(model)` only moves the
model to that device and registers it for the final weights' sha256 (Horovod wraps no model): the
optimizer is wrapped here, by the app, so it is not given to `run.setup` (which would wrap it again).
"""

import horovod.torch as hvd
import hydra
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import steadfast as sf


def make_data(size=4096, features=20, classes=4):
    """Random features (a fixed seed) and labels from a hidden linear rule."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, features, generator=g)
    return TensorDataset(x, (x @ torch.randn(features, classes, generator=g)).argmax(1))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg) as run:
        torch.manual_seed(0)
        model = run.setup(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr * hvd.size())
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        dataset = make_data()
        sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler)
        run.resume(model=model, optimizer=optimizer)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        for epoch in run.epochs(cfg.epochs):
            total, batches = 0.0, 0
            for x, y in run.batches(loader):  # sets the sampler's epoch; after a resume, skips the batches done
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
                loss.backward()
                optimizer.step()
                run.step(loss)
                total, batches = total + loss.item(), batches + 1
            train_loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="train_loss").item()  # the mean over ranks
            if batches:  # none when a resume found every batch of this epoch done
                run.log(train_loss=train_loss)
                if hvd.rank() == 0:
                    print(f"epoch {epoch + 1}/{cfg.epochs} loss {train_loss:.4f}")


if __name__ == "__main__":
    main()
