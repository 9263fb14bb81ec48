"""An app written the way people write them (tests/launcher/test_user_code.py, tests/config/test_app_keys.py): `from
torch.backends import cudnn` set inside main, a helper of its own that fails, a module-level object
that cannot be pickled, and a dataclass of its keys."""

import sys
import threading
from dataclasses import dataclass

import hydra
import torch
import torch.nn.functional as F
from torch import nn
from torch.backends import cudnn
from torch.utils.data import TensorDataset

import steadfast as sf

LOCK = threading.Lock() if "lock=true" in sys.argv else None  # the test's way to make main unpicklable


@dataclass
class Config:  # the app's keys, typed (tests/config/test_app_keys.py names it: hydra.launcher.app_schema=__main__:Config)
    seed: int = 0
    epochs: int = 1
    samples: int = 128
    fail_at_step: int = 0
    lock: bool = False


def check_batch(step, fail_at_step):
    if step == fail_at_step:
        raise ValueError(f"a bad batch at step {step}")  # the line a traceback must show


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    cudnn.benchmark = False  # a module that replaced itself in sys.modules (CudnnModule)
    if LOCK is not None:
        with LOCK:
            pass
    with sf.Run(cfg, seed=cfg.seed) as run:
        torch.manual_seed(cfg.seed)
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(cfg.samples, 8, generator=g)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.setup(model, optimizer)
        loader = run.loader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=16)
        run.resume(model=model, optimizer=optimizer)
        for _ in run.epochs(cfg.epochs):
            for xb, yb in loader:
                check_batch(run.global_step + 1, cfg.fail_at_step)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                run.step(loss)
        return run.finish()


if __name__ == "__main__":
    main()
