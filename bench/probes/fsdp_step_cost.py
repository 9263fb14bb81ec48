"""What a snapshot in memory costs an FSDP2 step, inside one pair of processes (so other tenants' load
hits every configuration alike).

    .venv/bin/python bench/probes/fsdp_step_cost.py [ROUNDS] [BLOCK]

Two workers under torchrun train bench.hot_loop's job (MLP 256-512-512-4, batch 64 per worker) under
FSDP2 (fully_shard on every Linear and on the model, as parallel=fsdp does) with AdamW, batches
sliced from the tensors, the anomaly watch observing each loss (its state is in each rank's
snapshot, as in a run), and switch every BLOCK steps (default 20) between configurations, in a
rotated order, ROUNDS times (default 12); medians of the blocks, wall time (rank 0) and CPU time
(both workers, every thread):

  bare         forward, backward, AdamW step
  state_dict   bare + model.state_dict() and optimizer.state_dict() every step (what a snapshot's plan reads)
  plan         bare + MemorySnapshots.plan every step (the sharded codec's layout of the tracked state)
  snapshot     bare + plan and MemorySnapshots.take every step (snapshot.every_n_steps=1)
  snapshot@8   bare + a snapshot every 8th step (about what snapshot.every_n_steps=auto chose in bench.sharded)

Also prints, per configuration, the median time of the step right after a snapshot step against
the others (a cost that shows up after the snapshot rather than in it), and the CPU time of the
training thread (time.thread_time, both workers' medians) that a snapshot's plan and its copy take. A development probe: its
figures are quoted in a commit or report, not in the tables.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("bare", "state_dict", "plan", "snapshot", "snapshot@8")


def worker(rounds: int, steps_per_block: int, out: Path, folder: Path) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import TensorDataset

    from bench.common import HOT
    from pipeline.data import synthetic
    from pipeline.models import MLP
    from steadfast.checkpoint.memory import MemorySnapshots
    from steadfast.checkpoint.state import Progress, RNGState
    from steadfast.config import AnomalyConf
    from steadfast.contract import shm
    from steadfast.distributed.comm import TorchDistComm
    from steadfast.health.watch import Watch

    comm = TorchDistComm(120)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // comm.local_world_size))
    torch.manual_seed(0)
    job = HOT
    data = synthetic(
        num_samples=job.num_samples, num_features=job.num_features, num_classes=job.num_classes, val_fraction=0.2, seed=0
    )
    model = MLP(data.input_shape, data.output_size, list(job.hidden), dropout=0.1)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert isinstance(data.train, TensorDataset)  # the synthetic data's
    features, labels = data.train.tensors
    segment = shm.LaunchFolder(folder)
    if comm.rank == 0:
        segment.create()
    memory = MemorySnapshots(shm.Segments(comm.broadcast_object(segment.name)), comm.rank, comm.local_rank, comm.world_size)
    progress = Progress()
    watch = Watch(AnomalyConf())  # a run's per-rank state holds the anomaly watch's, as pipeline.train's does
    shared, per_rank = {"model": model, "optimizer": optimizer, "progress": progress}, {"rng": RNGState(), "watch": watch}
    parts: Dict[str, List[float]] = {"plan": [], "take": []}  # a snapshot's, in thread CPU seconds
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(features), generator=g)[comm.rank :: comm.world_size]
    position = [0]

    def batch() -> Any:
        if position[0] + job.batch_size > len(order):
            position[0] = 0
        index = order[position[0] : position[0] + job.batch_size]
        position[0] += job.batch_size
        return features[index], labels[index]

    def block(config: str, steps: int) -> Dict[str, float]:
        name, _, every = config.partition("@")
        every_n = int(every) if every else 1
        walls: List[float] = []
        after: List[float] = []
        start, cpu = time.perf_counter(), time.process_time()
        snapped = False
        for i in range(steps):
            t = time.perf_counter()
            x, y = batch()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            progress.global_step += 1
            watch.observe(progress.global_step, loss.detach())
            if name == "state_dict":
                model.state_dict(), optimizer.state_dict()
            elif name == "plan" and i % every_n == 0:
                memory.plan(shared, per_rank)
            elif name == "snapshot" and i % every_n == 0:
                a = time.thread_time()
                planned = memory.plan(shared, per_rank)
                b = time.thread_time()
                memory.take(progress.global_step, planned)
                parts["plan"].append(b - a)
                parts["take"].append(time.thread_time() - b)
            dt = time.perf_counter() - t
            (after if snapped else walls).append(dt)
            snapped = name == "snapshot" and i % every_n == 0
        comm.barrier()
        return {
            "wall": (time.perf_counter() - start) / steps,
            "cpu": (time.process_time() - cpu) / steps,
            "step_after_snapshot": statistics.median(after) if after else 0.0,
            "other_steps": statistics.median(walls) if walls else 0.0,
        }

    block("bare", 3 * steps_per_block)  # warm-up
    samples: Dict[str, List[Dict[str, float]]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        k = r % len(CONFIGS)
        for config in CONFIGS[k:] + CONFIGS[:k]:
            samples[config].append(block(config, steps_per_block))
    every = comm.gather_object({"blocks": samples, "parts": parts})
    comm.barrier()
    comm.shutdown()
    if comm.rank == 0:
        segment.remove()
        assert every is not None
        out.write_text(json.dumps(every))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    block = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    sys.path.insert(0, str(ROOT))
    from bench.common import TORCHRUN, env

    with tempfile.TemporaryDirectory(prefix="sf-fsdp-step-cost-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", __file__, "--worker", str(rounds), str(block), str(out), tmp]
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=1800)
        if not out.exists():
            sys.exit(f"failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        gathered = json.loads(out.read_text())
    ranks = [r["blocks"] for r in gathered]
    bare = statistics.median(s["wall"] for s in ranks[0]["bare"])
    print(f"{rounds} rounds of {block}-step blocks, 2 workers, FSDP2 + AdamW")
    for config in CONFIGS:
        wall = statistics.median(s["wall"] for s in ranks[0][config])
        cpu = statistics.median(sum(r[config][i]["cpu"] for r in ranks) for i in range(rounds))
        base_cpu = statistics.median(sum(r["bare"][i]["cpu"] for r in ranks) for i in range(rounds))
        after = statistics.median(s["step_after_snapshot"] for s in ranks[0][config])
        other = statistics.median(s["other_steps"] for s in ranks[0][config])
        print(
            f"  {config:<11} {wall * 1e3:7.2f} ms/step  speed vs bare {bare / wall:.3f}   CPU {cpu * 1e3:7.2f} ms/step"
            f"  per CPU-second vs bare {base_cpu / cpu:.3f}   step after a snapshot {after * 1e3:6.2f} ms, others {other * 1e3:6.2f} ms"
        )
    plan, take = ([statistics.median(r["parts"][part]) * 1e3 for r in gathered] for part in ("plan", "take"))
    print(
        "  a snapshot on the training thread (thread CPU, median of each worker): plan "
        + ", ".join(f"{v:.3f}" for v in plan)
        + " ms; copy "
        + ", ".join(f"{v:.3f}" for v in take)
        + " ms"
    )


if __name__ == "__main__":
    main()
