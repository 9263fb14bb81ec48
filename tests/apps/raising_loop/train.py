"""A tiny own loop on steadfast that raises a chosen exception on a chosen rank at a chosen step, on
every attempt (the tests copy this folder out of the repository and run `python train.py`): what a
bug in a user's code, or a worker's own I/O error, looks like to the launcher.

    fail.rank: the rank that raises (-1: every rank; null: none)
    fail.at_step: it raises when it completes this step
    fail.error: the exception's type, one of ERRORS
    fail.message: its text; <ESC> and <BEL> in it become those control characters (a terminal escape)
"""

import hydra
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import steadfast as sf

ERRORS = {"TimeoutError": TimeoutError, "TypeError": TypeError, "ValueError": ValueError, "OSError": OSError}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=cfg.seed) as run:
        torch.manual_seed(cfg.seed)
        model = nn.Linear(8, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        model, optimizer = run.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(cfg.samples, 8, generator=g)
        loader = run.loader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=8)
        run.resume(model=model, optimizer=optimizer)
        for _ in run.epochs(cfg.epochs):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                run.step(loss)
                fail = cfg.fail
                if fail.rank is not None and fail.rank in (-1, run.rank) and run.global_step == fail.at_step:
                    raise ERRORS[fail.error](str(fail.message).replace("<ESC>", "\x1b").replace("<BEL>", "\x07"))
        return run.finish()


if __name__ == "__main__":
    main()
