"""What `run.step` costs, timed around the call itself, step by step, in a real loop.

    .venv/bin/python bench/probes/run_step_cost.py [--steps 4000] [--skip 500] [--log-every 10] [--progress lines|none]
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/probes/run_step_cost.py   # two ranks

A `steadfast.Run` trains section 7's tiny model shape (MLP 32-64-4, batch 8, SGD, one torch thread)
on random data for one epoch; every call of the loader's next batch, the forward and `run.step` is
timed with perf_counter, and the median, mean and 90th percentile are printed (the first `--skip` steps
left out: the attempt's start, the snapshot cadence's and the control plane's first intervals). The
mean is the library's amortised per-step cost: it includes the steps at which a metrics window
closes and those at which the control plane's message is read. Alone (no torchrun) it runs as the
one rank of a one-rank group; under torchrun rank 0 prints.

A development probe: its figures are quoted in a commit or report, not in the tables.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from steadfast import Run  # noqa: E402
from steadfast.contract.env import TORCH, LaunchEnv  # noqa: E402


def _environment(folder: Path) -> None:
    """What a launched worker has: a one-rank group of its own unless torchrun started this process."""
    env = LaunchEnv(backend="torchrun", collective=TORCH, run_dir=folder, collective_timeout_s=60).to_environ()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(env)


def _summary(name: str, seconds: List[float], skip: int) -> str:
    us = sorted(s * 1e6 for s in seconds[skip:])
    return (
        f"{name}: median {statistics.median(us):.1f} us, mean {statistics.mean(us):.1f} us, p90 {us[int(len(us) * 0.9)]:.1f} us"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--skip", type=int, default=500, help="the first steps, left out of the figures")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--progress", default="lines", choices=["lines", "none"])
    args = p.parse_args()
    if args.skip >= args.steps:
        p.error("--skip must be under --steps")
    if "RANK" in os.environ:  # under torchrun every rank shares one folder, named by the rendezvous port (left behind)
        folder = Path(tempfile.gettempdir()) / f"run_step_cost-{os.environ['MASTER_PORT']}"
        folder.mkdir(exist_ok=True)
        measure(folder, args)
    else:
        with tempfile.TemporaryDirectory(prefix="run_step_cost-") as tmp:
            measure(Path(tmp), args)


def measure(folder: Path, args: argparse.Namespace) -> None:
    _environment(folder)
    cfg = {"logger": {"progress": args.progress}, "checkpoint": {"every_n_epochs": None}}
    with Run(cfg, log_every_n_steps=args.log_every, num_threads=1) as run:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        wrapped, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        run.resume(model=model, optimizer=optimizer)
        samples = args.steps * 8 * run.comm.world_size
        loader = run.loader(TensorDataset(torch.randn(samples, 32), torch.randint(0, 4, (samples,))), batch_size=8)
        stepping: List[float] = []
        fetching: List[float] = []
        forward: List[float] = []
        clock = time.perf_counter
        for _ in run.epochs(1):
            batches = iter(loader)
            while True:
                began = clock()
                batch = next(batches, None)
                fetching.append(clock() - began)
                if batch is None:
                    break
                x, y = batch
                began = clock()
                out = wrapped(x)
                forward.append(clock() - began)
                loss = F.cross_entropy(out, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                began = clock()
                run.step(loss)
                stepping.append(clock() - began)
        if run.comm.rank == 0:
            print(f"{run.comm.world_size} rank(s), {len(stepping) - args.skip} steps timed")
            for name, seconds in (("run.step", stepping), ("a batch", fetching), ("the forward", forward)):
                print(_summary(name, seconds, args.skip))


if __name__ == "__main__":
    main()
