"""A compiled model's hot loop: an own loop on steadfast against the same loop hand-written.

    .venv/bin/python bench/probes/compile_hot_loop.py [--rounds 3] [--steps 600] [--compiler inductor] [--json PATH]

Both sides train the same model under `torch.compile` (Inductor), compiled before DDP (nanoGPT's
order), on 2 workers over Gloo, one torch thread each: an MLP 256-512-512-4 on in-memory random
data, batch 64 per worker, SGD. The two programs are written into a scratch folder from the same
model and data code (below):

  ours      a Hydra app: sf.Run, run.setup (DDP), run.loader, run.resume, run.epochs, run.step, run.finish;
            launched with `python train.py` (torchrun backend, snapshot=off, no checkpoint before the end)
  baseline  torchrun --standalone: init_process_group, DDP, each epoch one permutation sliced per rank

Figure: rank 0's steps per second from step 100 (compiled, warm) to the last step, timed in the loop
itself on both sides; the runs alternate in a rotated order each round, medians reported. The machine
is shared: read the ratio with the spread of the rounds. `--compiler`: torch.compile's backend (its
smoke test: eager, Dynamo's capture without Inductor's code generation).
A development probe: its figures are quoted in BENCHMARKS.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import env  # noqa: E402

WARM = 100  # steps before the timed window: the compile and the first epoch's start

SHARED = """
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

WARM = {warm}
STEPS = {steps}
COMPILER = {compiler!r}


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))


def dataset(world_size):
    g = torch.Generator().manual_seed(1234)
    n = 64 * world_size * 100  # 100 steps per epoch
    x = torch.randn(n, 256, generator=g)
    return TensorDataset(x, (x[:, :4] * 3).argmax(1))
"""

OURS = """
import hydra
import steadfast as sf
{shared}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=0) as run:
        model = torch.compile(build(), backend=COMPILER)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = run.setup(model, optimizer)
        loader = run.loader(dataset(run.world_size), batch_size=64)
        run.resume(model=model, optimizer=optimizer)
        started = None
        for _ in run.epochs(-(-STEPS // 100)):
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                run.step(loss)
                if run.global_step == WARM:
                    started = time.perf_counter()
        return run.finish(steps_per_s=(run.global_step - WARM) / (time.perf_counter() - started))


if __name__ == "__main__":
    main()
"""

CONFIG = """
defaults:
  - steadfast
  - backend: torchrun
  - restart: none
  - checkpoint: every_10_epochs
  - override snapshot: "off"
  - _self_
run:
  name: ours
hydra:
  searchpath: [pkg://steadfast.conf]
"""

BASELINE = """
import json
import os
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
{shared}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.compile(build(), backend=COMPILER))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = dataset(world)
    x_all, y_all = data.tensors
    step, started = 0, None
    for epoch in range(-(-STEPS // 100)):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))[rank::world]
        for i in range(0, len(order) - 63, 64):
            index = order[i : i + 64]
            x, y = x_all[index], y_all[index]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if step == WARM:
                started = time.perf_counter()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({{"steps_per_s": (step - WARM) / (time.perf_counter() - started)}}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def one(kind: str, folder: Path) -> float:
    if kind == "ours":
        shutil.rmtree(folder / "outputs", ignore_errors=True)
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "baseline.py", "out.json"]
    proc = subprocess.run(cmd, cwd=folder, env=env(extra={"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    found = folder / ("outputs/ours/summary.json" if kind == "ours" else "out.json")
    return float(json.loads(found.read_text())["steps_per_s"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--compiler", default="inductor", help="torch.compile's backend")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.steps <= WARM:
        p.error(f"--steps must be over {WARM}: the steps before the timed window")
    shared = SHARED.format(warm=WARM, steps=args.steps, compiler=args.compiler)
    rates: Dict[str, List[float]] = {"ours": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "conf").mkdir()
        (folder / "conf" / "config.yaml").write_text(CONFIG)
        (folder / "train.py").write_text(OURS.format(shared=shared))
        (folder / "baseline.py").write_text(BASELINE.format(shared=shared))
        for r in range(args.rounds):
            for kind in ("ours", "baseline") if r % 2 == 0 else ("baseline", "ours"):
                rates[kind].append(one(kind, folder))
                print(kind, r, round(rates[kind][-1], 1), flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = {"rounds": rates, "median_steps_per_s": medians, "ratio": medians["ours"] / medians["baseline"]}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
