"""What the run's loader costs per batch, against indexing the tensors and against torch's DataLoader.

    .venv/bin/python bench/probes/loader_cost.py [--rounds 15] [--job tiny|hot] [--json PATH]

One process, one torch thread, no training: rank 0 of 2 reads whole epochs of the benchmark jobs'
synthetic data (bench.common TINY: 32 features, batch 32; HOT: 256 features, batch 64) through each
way, interleaved epoch by epoch in a rotated order so that other tenants' load hits them alike; the
figure is the median over the rounds of an epoch's wall time per batch (and CPU time per batch).

  slices          an epoch's permutation, this rank's share, `x[index], y[index]` per batch (bench/baseline_ddp.py --loader slices)
  index_select    the same with `index_select` (what TensorBatches does)
  tensor_batches  steadfast.loop.data's ResumableSampler + TensorBatches
  run_loader      what `run.loader` hands a loop: TensorBatches counted into the run's position, and the
                  position's move into the progress that `run.step` makes (RunData.stepped)
  dataloader      torch's DataLoader over the TensorDataset with a DistributedSampler (the usual script)

A development probe: its figures are quoted in a commit or report, not in the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from bench.common import HOT, TINY  # noqa: E402
from pipeline.data import synthetic  # noqa: E402
from steadfast.checkpoint.state import Progress  # noqa: E402
from steadfast.loop.data import ResumableSampler, RunData, TensorBatches  # noqa: E402

WORLD, RANK = 2, 0


def ways(job: str) -> Dict[str, Callable[[int], Iterator[object]]]:
    spec = HOT if job == "hot" else dataclasses.replace(TINY, num_samples=40960)
    data = synthetic(num_samples=spec.num_samples, num_features=spec.num_features, num_classes=spec.num_classes, seed=0)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
    x, y = data.train.tensors
    size = spec.batch_size

    def share(epoch: int) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(epoch)
        order = torch.randperm(len(x), generator=g)
        return order[: len(order) - len(order) % WORLD][RANK::WORLD]

    def slices(epoch: int) -> Iterator[object]:
        order = share(epoch)
        for begin in range(0, len(order), size):
            index = order[begin : begin + size]
            yield x[index], y[index]

    def index_select(epoch: int) -> Iterator[object]:
        order = share(epoch)
        for begin in range(0, len(order), size):
            index = order[begin : begin + size]
            yield x.index_select(0, index), y.index_select(0, index)

    sampler = ResumableSampler(len(x), WORLD, RANK, 0, size)

    def tensor_batches(epoch: int) -> Iterator[object]:
        sampler.start(epoch)
        return iter(TensorBatches((x, y), sampler, size))

    progress = Progress()
    run_data = RunData(WORLD, RANK, 0, progress, 1)
    loader = run_data.loader(data.train, size, True)

    def run_loader(epoch: int) -> Iterator[object]:
        progress.epoch, progress.batch_in_epoch, progress.sample_in_epoch = epoch, 0, 0
        run_data.begin_epoch()
        for batch in loader:
            run_data.stepped()
            yield batch
        run_data.end_epoch()

    torch_sampler: DistributedSampler[int] = DistributedSampler(data.train, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)

    def dataloader(epoch: int) -> Iterator[object]:
        torch_sampler.set_epoch(epoch)
        return iter(DataLoader(data.train, batch_size=size, sampler=torch_sampler))

    return {
        "slices": slices,
        "index_select": index_select,
        "tensor_batches": tensor_batches,
        "run_loader": run_loader,
        "dataloader": dataloader,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--job", choices=("tiny", "hot"), default="tiny")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    made = ways(args.job)
    names = list(made)
    wall: Dict[str, List[float]] = {n: [] for n in names}
    cpu: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start, used, batches = time.perf_counter(), time.process_time(), 0
            for _ in made[name](r):
                batches += 1
            if r:
                wall[name].append((time.perf_counter() - start) / batches)
                cpu[name].append((time.process_time() - used) / batches)
    out = {
        n: {
            "us_per_batch": statistics.median(wall[n]) * 1e6,
            "min_us": min(wall[n]) * 1e6,
            "max_us": max(wall[n]) * 1e6,
            "cpu_us_per_batch": statistics.median(cpu[n]) * 1e6,
        }
        for n in names
    }
    base = out["slices"]["us_per_batch"]
    print(f"loader cost per batch ({args.job} job, rank 0 of {WORLD}, {args.rounds} rounds; medians, min..max)")
    for n, v in out.items():
        print(
            f"  {n:<15} {v['us_per_batch']:8.1f} us  ({v['min_us']:.1f}..{v['max_us']:.1f})  "
            f"CPU {v['cpu_us_per_batch']:8.1f} us   x slices {v['us_per_batch'] / base:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"job": args.job, "rounds": args.rounds, "per_batch": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
