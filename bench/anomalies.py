"""The anomaly guard's cost per step, the replicas' fingerprint's, and the steps a rollback loses.

    python -m bench.anomalies [--rounds 12] [--block 64] [--quick | --tiny] [--json PATH]

1. Inside one pair of torchrun workers training the hot-loop job (bench.common.HOT: MLP 256-512-512-10,
   batch 64, SGD, Gloo), blocks of steps alternate, in a rotated order, between configurations;
   medians of the blocks, in wall-clock time (rank 0) and CPU time (both workers), as in
   bench/step_cost.py:

     bare          forward, backward, SGD step, and the stop agreement's message at its automatic interval
     watched       bare + the guard (steadfast/health/guard.py), the spike rule on (anomaly=spikes): each step's
                   loss into the watch and the step's data position, the verdict riding the agreement's message
                   (the host's path: a CPU loss)
     watched_gpu   the same on the device's path (what a GPU runs: the losses judged a block at a time in a
                   few tensor operations, the verdict copied behind an event), here on the CPU
     fingerprint   bare + a fingerprint of the replicated parameters at every step, riding the message;
                   its cost at the default interval (anomaly.fingerprint_every_n_steps=100) is a hundredth

2. The device's path in tensor operations per step (each is a kernel launch on a GPU), counted.
3. A rollback: `python -m pipeline.train` on the hot-loop job (snapshots and intervals at their
   defaults) with fault=nan_loss on rank 1: the steps between the state every rank went back to and
   the step at which they agreed (trained again), and where the state came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("bare", "watched", "watched_gpu", "fingerprint")
FINGERPRINT_EVERY = 100  # anomaly.fingerprint_every_n_steps' default


def _worker(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]
    import torch
    import torch.nn.functional as F

    from bench.common import HOT, TINY
    from pipeline.data import synthetic
    from pipeline.models import MLP
    from steadfast.checkpoint.state import Progress
    from steadfast.config import AnomalyConf
    from steadfast.distributed import init
    from steadfast.distributed.exchange import Exchange
    from steadfast.health import replicas
    from steadfast.health.guard import Guard
    from steadfast.health.watch import Watch
    from steadfast.loop.agreement import StopAgreement

    job = TINY if args.tiny_job else HOT
    SPIKES = AnomalyConf(spike_zscore=6.0, spike_ratio=2.0)  # anomaly=spikes: the dearer rule, measured
    comm = init("torch", 120)
    torch.manual_seed(0)
    data = synthetic(job.num_samples, job.num_features, job.num_classes, val_fraction=0.2, seed=0)
    inner = MLP(data.input_shape, data.output_size, list(job.hidden), dropout=0.1)
    model = comm.wrap_model(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    features, labels = data.train.tensors  # type: ignore[attr-defined]
    progress = Progress()
    agreement = StopAgreement(Exchange(comm, None))
    exchange = agreement.exchange
    params = replicas.replicated(inner)
    guards = {
        "watched": Guard(Watch(SPIKES), exchange, progress, None, 0),
        "watched_gpu": Guard(Watch(SPIKES, judge_later=True), exchange, progress, None, 0),
        "fingerprint": Guard(Watch(SPIKES), exchange, progress, lambda: params, 1),
    }
    active: List[str] = [""]
    riders = list(exchange._riders)  # the guards' own, asked only in their blocks (the same on every rank)
    exchange._riders = [r for r in exchange._riders if r not in [g._post for g in guards.values()]]

    spent = [0.0]  # seconds in the guard's own calls this block (rank 0 times them)

    def ride(step: int, at_once: bool) -> None:
        guard = guards.get(active[0])
        if guard is not None:
            began = time.perf_counter()
            guard._post(step, at_once)
            spent[0] += time.perf_counter() - began

    exchange.ride(ride)
    del riders
    order = torch.randperm(len(features))[comm.rank :: comm.world_size]
    at = [0]

    def step(config: str) -> None:
        i = at[0] % (len(order) // job.batch_size)
        at[0] += 1
        index = order[i * job.batch_size : (i + 1) * job.batch_size]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(features[index]), labels[index])
        loss.backward()
        optimizer.step()
        progress.global_step += 1
        progress.batch_in_epoch, progress.sample_in_epoch = i + 1, (i + 1) * job.batch_size * comm.world_size
        guard = guards.get(config)
        if guard is not None:
            began = time.perf_counter()
            guard.observe(progress.global_step, loss, None)
            guard.at_step(progress.global_step)
            spent[0] += time.perf_counter() - began
        agreement.at_step(progress.global_step)

    inside: Dict[str, List[float]] = {c: [] for c in CONFIGS}  # per block: seconds per step in the guard's calls

    def block(config: str, steps: int) -> tuple:
        active[0], spent[0] = config, 0.0
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(config)
        agreement.drain(progress.global_step)
        inside[config].append(spent[0] / steps)
        return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps

    for config in CONFIGS:  # warm-up, and the agreement's automatic interval from steps in a row
        block(config, args.block)
    exchange.auto = False
    times: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    cpu: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        k = r % len(CONFIGS)
        for config in CONFIGS[k:] + CONFIGS[:k]:
            wall, used = block(config, args.block)
            times[config].append(wall)
            cpu[config].append(used)
    found = [g.found for g in guards.values() if g.found is not None]
    every_rank = comm.gather_object(cpu)
    comm.barrier()
    if comm.rank == 0:
        assert every_rank is not None
        total = {c: [sum(x[c][i] for x in every_rank) for i in range(args.rounds)] for c in CONFIGS}
        out = {"seconds_per_step": times, "cpu_seconds_per_step": total, "agreement_every": exchange.every}
        out["guard_seconds_per_step"] = {c: v[-args.rounds :] for c, v in inside.items()}
        out["false_findings"] = [f.kind for f in found]
        Path(args.out).write_text(json.dumps(out))
    comm.shutdown()


def device_ops_per_step(steps: int = 512, every: int = 64) -> Dict[str, float]:
    """Tensor operations the device's path dispatches per step (a GPU kernel each, at most), counted on the
    CPU: each step's loss observed, a verdict every `every` steps (the automatic exchange interval of a
    step of about 8 ms: CONTROL_INTERVAL_S / 8 ms, a power of two)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from steadfast.config import AnomalyConf
    from steadfast.health.watch import Watch

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    watch = Watch(AnomalyConf(spike_zscore=6.0, spike_ratio=2.0), judge_later=True)
    losses = [torch.tensor(1.0 + 0.01 * (i % 7)) for i in range(steps)]
    with Count():
        for step, loss in enumerate(losses, start=1):
            watch.observe(step, loss)
            if step % every == 0:
                watch.verdict(step, at_once=False)
    return {"ops_per_step": Count.ops / steps, "steps": steps, "verdict_every": every}


def host_us_per_step(steps: int = 20000) -> Dict[str, float]:
    """The host's path alone, timed in this process: a CPU loss into the watch (its verdict every 16 steps)."""
    import torch

    from steadfast.config import AnomalyConf
    from steadfast.health.watch import Watch

    watch = Watch(AnomalyConf(spike_zscore=6.0, spike_ratio=2.0))
    losses = [torch.tensor(1.0 + 0.01 * (i % 7)) for i in range(steps)]
    began = time.perf_counter()
    for step, loss in enumerate(losses, start=1):
        watch.observe(step, loss)
        if step % 16 == 0:
            watch.verdict(step, at_once=False)
    return {"us_per_step": (time.perf_counter() - began) / steps * 1e6}


def rollback(tiny: bool, timeout: float = 600) -> Dict[str, Any]:
    """The built-in trainer with a NaN loss on rank 1: the steps trained again, and from where."""
    from .common import HOT, TINY, Workdir, run_ours

    job = TINY if tiny else HOT
    at = max(20, job.steps_per_epoch() // 2)
    with Workdir() as work:
        run = run_ours(work, "nan", [*job.overrides(), "fault=nan_loss", "fault.rank=1", f"fault.at_step={at}"], timeout=timeout)
        if not run.ok:
            raise RuntimeError(f"the run with a NaN loss failed:\n{run.tail()}")
        found = [e for e in run.events if e.get("event") == "anomaly"]
        rows = run.step_rows()
    if len(found) != 1:
        raise RuntimeError(f"expected one anomaly record, found {len(found)}")
    e = found[0]
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:]) if b["step"] > a["step"]]
    step_s = statistics.median(gaps) if gaps else None
    lost = e["agreed_at"] - e["restored_step"]
    return {
        "job": "tiny" if tiny else "hot",
        "nan_at_step": e["step"],
        "agreed_at": e["agreed_at"],
        "restored_step": e["restored_step"],
        "source": e["source"],
        "steps_trained_again": lost,
        "seconds_per_step": step_s,
        "seconds_lost": lost * step_s if step_s else None,
        "samples_skipped": (e.get("skipped") or [0, 0, 0])[2],
    }


def measure(rounds: int, block: int, tiny: bool, timeout: float = 900) -> Dict[str, Any]:
    from .common import TORCHRUN, env

    with tempfile.TemporaryDirectory(prefix="steadfast-anomalies-") as tmp:
        out = Path(tmp) / "times.json"
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(Path(__file__).resolve()), "--worker"]
        cmd += ["--rounds", str(rounds), "--block", str(block), "--out", str(out), *(["--tiny-job"] if tiny else [])]
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=tmp)
        if not out.exists():
            raise RuntimeError(f"anomalies workers failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        raw = json.loads(out.read_text())
    per = {k: statistics.median(v) for k, v in raw["seconds_per_step"].items()}
    cpu = {k: statistics.median(v) for k, v in raw["cpu_seconds_per_step"].items()}
    bare, bare_cpu = per["bare"], cpu["bare"]
    extra = {k: v - bare for k, v in per.items()}
    extra_cpu = {k: v - bare_cpu for k, v in cpu.items()}
    guard = {k: statistics.median(v) for k, v in raw["guard_seconds_per_step"].items()}
    return {
        "job": "tiny" if tiny else "hot",
        # the guard's own calls timed around them (rank 0, medians of blocks): the direct, low-noise view
        "guard_us_per_step": {k: v * 1e6 for k, v in guard.items() if k != "bare"},
        "guard_share_of_step": {k: v / bare for k, v in guard.items() if k != "bare"},
        "rounds": rounds,
        "block_steps": block,
        "agreement_every": raw["agreement_every"],
        "false_findings": raw["false_findings"],
        "ms_per_step": {k: v * 1e3 for k, v in per.items()},
        "extra_us_per_step": {k: v * 1e6 for k, v in extra.items()},
        "share_of_step": {k: v / bare for k, v in extra.items()},
        "cpu_ms_per_step (both workers)": {k: v * 1e3 for k, v in cpu.items()},
        "extra_cpu_us_per_step": {k: v * 1e6 for k, v in extra_cpu.items()},
        "cpu_share_of_step": {k: v / bare_cpu for k, v in extra_cpu.items()},
        # the fingerprint at the default interval: its cost once (timed around it), spread over the interval's steps
        "fingerprint_default_share_of_step": max(0.0, guard["fingerprint"] - guard["watched"]) / FINGERPRINT_EVERY / bare,
        "fingerprint_us": max(0.0, guard["fingerprint"] - guard["watched"]) * 1e6,
        "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in raw["seconds_per_step"].items()},
    }


def report(res: Dict[str, Any]) -> None:
    print(f"\nAnomaly guard ({res['job']} job, {res['rounds']} rounds of {res['block_steps']}-step blocks)")
    inside, share = res["guard_us_per_step"], res["guard_share_of_step"]
    print(
        "  timed around the guard's calls (rank 0, medians of blocks): "
        + ", ".join(f"{k} {inside[k]:.2f} us ({100 * share[k]:.3f}% of a step)" for k in inside)
    )
    for k in res["ms_per_step"]:
        print(
            f"  {k:<12} {res['ms_per_step'][k]:7.3f} ms/step  {res['extra_us_per_step'][k]:+8.1f} us "
            f"({100 * res['share_of_step'][k]:+.2f}%)   CPU {res['extra_cpu_us_per_step'][k]:+8.1f} us "
            f"({100 * res['cpu_share_of_step'][k]:+.2f}%)"
        )
    print(
        f"  fingerprint: {res['fingerprint_us']:.1f} us each; every {FINGERPRINT_EVERY} steps "
        f"{100 * res['fingerprint_default_share_of_step']:.4f}% of a step"
    )
    print(
        f"  host path alone: {res['host']['us_per_step']:.2f} us per step; device path: {res['device']['ops_per_step']:.2f} ops per step"
    )
    rb = res.get("rollback")
    if rb:
        print(
            f"  rollback: NaN at step {rb['nan_at_step']}, agreed at {rb['agreed_at']}, back to {rb['restored_step']} "
            f"({rb['source']}): {rb['steps_trained_again']} steps trained again"
            + (f" ({rb['seconds_lost']:.3f} s)" if rb["seconds_lost"] is not None else "")
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="6 rounds, and the rollback on the tiny job")
    p.add_argument("--tiny", action="store_true", help="1 round of 8-step blocks on the tiny job (smoke test)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tiny-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    from .common import RESULTS, command_line, log, machine, write_json

    rounds, block = (6 if args.quick else args.rounds), args.block
    if args.tiny:
        rounds, block = 1, 8
    log(f"anomalies: {rounds} rounds of {block}-step blocks")
    out: Dict[str, Any] = {
        "benchmark": "anomalies",
        "command": command_line("bench.anomalies", argv),
        "machine": machine(),
        **measure(rounds, block, tiny=args.tiny),
        "host": host_us_per_step(2000 if args.tiny else 20000),
        "device": device_ops_per_step(),
        "rollback": rollback(tiny=args.tiny or args.quick),
    }
    report(out)
    write_json(args.json or RESULTS / "anomalies.json", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
