"""What `run.step` costs, timed around the call itself, step by step, in a real loop.

    .venv/bin/python bench/probes/run_step_cost.py [--job tiny|hot] [--steps 4000] [--skip 500] [--log-every 10]
        [--progress lines|none] [--launched | --heartbeat] [--control-every N] [--checkpoint-every N] [--profile N]
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/probes/run_step_cost.py   # two ranks

A `steadfast.Run` trains a model on random data for one epoch (`--job tiny`: section 7's tiny model
shape, MLP 32-64-4, batch 8; `--job hot`: the hot-loop job's, MLP 256-512-512-10, batch 64, as
bench.step_cost's `run`), SGD, one torch thread. `run.step` is timed around the call in CPU time
(time.thread_time: this thread's, so another tenant's load hardly moves it) and in wall-clock time
(perf_counter), the first `--skip` steps left out (the attempt's start, the first intervals of the
snapshot cadence and the control plane). Each step is put in a category by what its boundary does,
read from the run's state before the call:

  quiet       nothing due but counting (steadfast/loop/boundary.py: most steps)
  window      a metrics window closes (every --log-every steps; alone, in the boundary's quiet path)
  exchange    the control plane's message is read and the next one sent (its rows are written here)
  snapshot    a snapshot in memory is taken (--launched only: a launched worker has the folder)
  checkpoint  the step cadence commits a checkpoint (--checkpoint-every)
  fingerprint the replicas' fingerprint (anomaly.fingerprint_every_n_steps)

(a whole boundary with several of them is named by all, joined with '+'; one with none, `other`).
Per category: the steps, the mean CPU us per step, and its share of the amortised cost (the mean
over every step). `--launched`: as a worker of steadfast's launcher, with the heartbeat file and the
launch's snapshot folder in shared memory (snapshot.every_n_steps=auto); without it, as
bench.step_cost's `run` (neither); `--heartbeat`: the heartbeat alone, as bench.step_cost's `run` has it
(a step counts; the heartbeat's thread writes the count: its CPU is not in the figures, which time
the training thread). `--control-every N`: the control plane's message every N steps
(default 128, as bench.step_cost's one rank; 0: its automatic interval, which follows the wall-clock
time of a step, so a loaded machine moves it). `--profile N`: cProfile around the calls of run.step only, the N
functions with the most internal time, then the N with the most cumulative time.
Alone (no torchrun) it runs as the one rank of a one-rank group; under torchrun rank 0 prints.

A development probe: its figures are quoted in a commit or report, not in the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from steadfast import Run  # noqa: E402
from steadfast.contract import shm  # noqa: E402
from steadfast.contract.env import TORCH, LaunchEnv  # noqa: E402
from steadfast.contract.heartbeat import start_heartbeat  # noqa: E402

JOBS = {"tiny": ((32, 64), 4, 8), "hot": ((256, 512, 512), 10, 64)}  # (layer widths, classes, batch size)


def _environment(folder: Path, snapshot: str) -> None:
    """What a launched worker has: a one-rank group of its own unless torchrun started this process."""
    env = LaunchEnv(backend="torchrun", collective=TORCH, run_dir=folder, collective_timeout_s=60, snapshot=snapshot).to_environ()
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


def _category(run: Run, step: int) -> str:
    """What the boundary of `step` (the next run.step) does, from the run's state before the call."""
    boundary = run.boundary
    if step < boundary.quiet_until:  # a window closes in the quiet path when nothing else is due
        return "window" if step == boundary.window_at else "quiet"
    parts = []
    if step % run.telemetry.every == 0:
        parts.append("window")
    if run.exchange.due(step):
        parts.append("exchange")
    memory = boundary.memory
    if memory is not None and (memory._last is None or step - memory._last >= memory.every):
        parts.append("snapshot")
    if run.cadence.step_due(step):
        parts.append("checkpoint")
    guard = boundary.guard
    if guard is not None and guard.next_due(step - 1) == step:
        parts.append("fingerprint")
    return "+".join(parts) or "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="tiny", choices=sorted(JOBS))
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--skip", type=int, default=500, help="the first steps, left out of the figures")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--progress", default="lines", choices=["lines", "none"])
    p.add_argument("--launched", action="store_true", help="the heartbeat and the snapshot folder of a launched worker")
    p.add_argument("--heartbeat", action="store_true", help="the heartbeat alone (bench.step_cost's run)")
    p.add_argument(
        "--control-every",
        type=int,
        default=128,
        help="stop_check_every_n_steps (default 128, bench.step_cost's one rank; 0: automatic)",
    )
    p.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint.every_n_steps (default: none)")
    p.add_argument("--profile", type=int, default=0, help="cProfile run.step; print this many functions")
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
    segment: Optional[shm.LaunchFolder] = None
    if args.launched and "RANK" not in os.environ:  # the launcher's part: one node's private snapshot folder
        segment = shm.LaunchFolder(folder)
        segment.create()
    try:
        _environment(folder, segment.name if segment else "")
        if args.launched or args.heartbeat:
            start_heartbeat(folder, int(os.environ["RANK"]))
        _train(folder, args)
    finally:
        if segment is not None:
            segment.remove()


def _train(folder: Path, args: argparse.Namespace) -> None:
    widths, classes, batch = JOBS[args.job]
    cfg = {
        "logger": {"progress": args.progress},
        "checkpoint": {"every_n_epochs": None, "every_n_steps": args.checkpoint_every},
    }
    profile = cProfile.Profile(time.thread_time) if args.profile else None  # CPU time: a loaded machine hardly moves it
    with Run(cfg, log_every_n_steps=args.log_every, stop_check_every_n_steps=args.control_every or None, num_threads=1) as run:
        torch.manual_seed(0)
        layers: List[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(widths[-1], classes))
        wrapped, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        run.resume(model=model, optimizer=optimizer)
        samples = args.steps * batch * run.comm.world_size
        data = TensorDataset(torch.randn(samples, widths[0]), torch.randint(0, classes, (samples,)))
        loader = run.loader(data, batch_size=batch)
        stepping: List[Tuple[str, float, float]] = []  # per step: its category, CPU seconds, wall seconds
        clock, cpu = time.perf_counter, time.thread_time
        for _ in run.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(wrapped(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                kind = _category(run, run.global_step + 1)
                timed = len(stepping) >= args.skip
                if profile is not None and timed:
                    profile.enable()
                began, began_cpu = clock(), cpu()
                run.step(loss)
                used, took = cpu() - began_cpu, clock() - began
                if profile is not None and timed:
                    profile.disable()
                stepping.append((kind, used, took))
        if run.comm.rank == 0:
            _report(run, stepping, args, profile)


def _report(
    run: Run, stepping: List[Tuple[str, float, float]], args: argparse.Namespace, profile: Optional[cProfile.Profile]
) -> None:
    timed = stepping[args.skip :]
    memory = run.boundary.memory
    print(
        f"{run.comm.world_size} rank(s), {args.job} job, {len(timed)} steps timed; control plane every {run.exchange.every} steps,"
        f" snapshots {'every %d steps' % memory.every if memory is not None else 'off'}, log_every_n_steps={args.log_every}"
    )
    print(_summary("run.step CPU (thread_time)", [s for _, s, _ in stepping], args.skip))
    print(_summary("run.step wall (perf_counter)", [w for _, _, w in stepping], args.skip))
    total = sum(s for _, s, _ in timed)
    by: Dict[str, List[float]] = defaultdict(list)
    for kind, cpu_s, _ in timed:
        by[kind].append(cpu_s)
    print(f"{'category':<32}{'steps':>7}{'CPU us/step':>13}{'median':>9}{'amortised us':>14}{'share':>8}")
    for kind, used in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"{kind:<32}{len(used):>7}{1e6 * statistics.mean(used):>13.1f}{1e6 * statistics.median(used):>9.1f}"
            f"{1e6 * sum(used) / len(timed):>14.2f}{100 * sum(used) / total:>7.1f}%"
        )
    print(f"{'all (amortised)':<32}{len(timed):>7}{1e6 * total / len(timed):>13.1f}")
    if profile is not None:
        for order in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.profile)
            print(out.getvalue())


if __name__ == "__main__":
    main()
