"""Scaling with the work: the hot-loop and start-up ratios from a tiny model to one of a few hundred
MB of parameters, and from 1 to 2 to 4 workers; checkpoint cost and recovery for the big model.

    python -m bench.scaling [--rounds 2] [--workers 1,4] [--big-hidden 8192,8192] [--quick | --tiny | --tiny-model] [--json PATH]

Workers: the hot-loop job with half its data (bench.common.HOT, 192 steps at 2 workers) with 1 and 4 workers, ours vs the
baseline alternated (2 workers is bench.hot_loop's figure). 4 workers on this 2-core machine
are oversubscribed (two processes per core); every worker has one torch thread here, so 1 worker
uses one core.

Model size: the tiny model (MLP 64-64, 6.5 k parameters; one epoch of 410 steps per worker, so the
window measured is about a second of steps with no epoch end in it) and a big one (MLP 256 -> 8192 -> 8192 -> 4,
69 M parameters, 277 MB of float32; with SGD momentum a checkpoint is ~554 MB; batch 4, 8 steps
per worker: a step is mostly the 277 MB all-reduce), 2 workers, ours vs the baseline alternated;
then one run of ours on the big model with a sync checkpoint every 3 steps and rank 1 SIGKILLed
at step 4 (fault=kill_rank): the save cost, the slowdown it causes, and the recovery (kill to the
first step after resuming from ~554 MB) vs the cold start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .common import (
    HOT,
    RESULTS,
    TINY,
    Job,
    Run,
    Workdir,
    aborted_at_exit,
    alternate,
    check,
    command_line,
    cpu_per_step,
    fmt,
    foreign,
    log,
    machine,
    median,
    ratio,
    run_baseline,
    run_ours,
    spread,
    steady_rate,
    write_json,
)

BIG = Job(num_samples=80, num_features=256, hidden=(8192, 8192), batch_size=4, epochs=1, log_every=1)  # 8 steps per worker


def pair(work: Workdir, job: Job, rounds: int, label: str, timeout: float = 400) -> Dict[str, Any]:
    warm = max(2, min(30, job.steps_per_epoch() // 3))
    extra = ["checkpoint.every_n_epochs=1000"]
    makers = [
        ("baseline", lambda: run_baseline(work, f"{label}-baseline", job, timeout, sample_cpu=True)),
        ("ours", lambda: run_ours(work, f"{label}-ours", job.overrides() + extra, timeout, sample_cpu=True)),
    ]

    def show(name: str, r: int, run: Run) -> None:
        check(run, f"scaling {label} {name}")
        log(
            f"  {label} round {r + 1} {name:<9} steps/s {fmt(steady_rate(run, warm), 2):>7}  ttfs {fmt(run.ttfs(), 2)} s  wall {run.wall:.1f} s"
        )

    runs = alternate(rounds, makers, show)
    rates = {k: [steady_rate(r, warm) for r in v] for k, v in runs.items()}
    cpu = {k: [(cpu_per_step(r, warm) or {}).get("total_cpu_s_per_step") for r in v] for k, v in runs.items()}
    ttfs = {k: [r.ttfs() for r in v] for k, v in runs.items()}
    return {
        "job": job.describe(),
        "rounds": rounds,
        "warmup_steps": warm,
        "steps_per_s": {k: spread(v) for k, v in rates.items()},
        "samples_per_s": {k: (median(v) or 0) * job.batch_size * job.workers for k, v in rates.items()},
        "ttfs_s": {k: spread(v) for k, v in ttfs.items()},
        "foreign_load": {k: foreign(v) for k, v in runs.items()},
        "baseline_aborted_at_exit": aborted_at_exit(runs["baseline"]),
        "cpu_s_per_step": {k: spread(v) for k, v in cpu.items()},
        "ours/baseline steps_per_s": ratio(median(rates["ours"]), median(rates["baseline"])),
        "ours/baseline steps per CPU-second": ratio(median(cpu["baseline"]), median(cpu["ours"])),
        "ours/baseline ttfs": ratio(median(ttfs["ours"]), median(ttfs["baseline"])),
    }


def big_checkpoint_and_recovery(
    work: Workdir, job: Job, every: int = 3, kill_at: int = 4, timeout: float = 400
) -> Dict[str, Any]:
    overrides = job.overrides() + [
        "checkpoint=every_n_steps",
        f"checkpoint.every_n_steps={every}",
        "fault=kill_rank",
        "fault.rank=1",
        f"fault.at_step={kill_at}",
        "fault.times=1",
        "restart.max_restarts=2",
    ]
    run = run_ours(work, "big-ckpt-kill", overrides, timeout)
    check(run, "scaling big checkpoint + recovery")
    saves = [e for e in run.events if e.get("event") == "checkpoint_saved"]
    fired = next((e for e in run.events if e.get("event") == "fault_fired"), None)
    back = run.first_step_time(1)
    recovery = back - fired["time"] if fired and back else None
    rate_clean = steady_rate(run, 1)
    rate_all = steady_rate(run, 1, exclude_checkpoints=False, how="mean")
    resumed = next((e for e in run.events if e.get("event") == "resumed"), None)
    return {
        "checkpoint_every_n_steps": every,
        "kill_at_step": kill_at,
        "checkpoint_bytes": median([e["bytes"] for e in saves]),
        "sync_save_s": median([e["seconds"] for e in saves]),
        "steps_per_s_clean": rate_clean,
        "steps_per_s_with_checkpoints": rate_all,
        f"ckpt every {every} steps / no ckpt steps_per_s (within run)": ratio(rate_all, rate_clean),
        "cold_ttfs_s": run.ttfs(),
        "recovery_s": recovery,
        "recovery/cold_ttfs": ratio(recovery, run.ttfs()),
        "resumed_from_step": resumed.get("step") if resumed else None,
        "load": run.extra.get("load"),
    }


# The tiny job's model, with enough steps in one epoch for a steady rate: the tiny job's own 26 steps
# an epoch measured 44 steps (0.15 s) across an epoch end, and moved by 60% between rounds.
TINY_STEADY = dataclasses.replace(TINY, num_samples=32768, epochs=1)


def measure(rounds: int, workers: List[int], big: Optional[Job], with_big_ckpt: bool, with_tiny: bool = True) -> Dict[str, Any]:
    hot = dataclasses.replace(HOT, num_samples=HOT.num_samples // 2)
    out: Dict[str, Any] = {"workers": {}, "model_size": {}}
    with Workdir() as work:
        for w in workers:
            # one torch thread per worker at every count: 1 worker uses one core, 4 share two (2 threads
            # per worker spin-wait in OpenMP when another tenant takes a core, which swamps the comparison)
            out["workers"][str(w)] = pair(work, dataclasses.replace(hot, workers=w, threads=1), rounds, f"{w}w")
            if w > (os.cpu_count() or 1):
                out["workers"][str(w)]["note"] = f"oversubscribed: {w} workers on {os.cpu_count()} cores"
        if with_tiny:
            out["model_size"]["tiny"] = pair(work, TINY_STEADY, rounds, "tiny")
        if big is not None:
            out["model_size"]["big"] = pair(work, big, rounds, "big")
        if big is not None and with_big_ckpt:
            out["big_checkpoint_and_recovery"] = big_checkpoint_and_recovery(work, big)
    return out


def report(res: Dict[str, Any]) -> None:
    print("\nScaling")
    rows: List[Tuple[str, Dict[str, Any]]] = [(f"{k} worker(s), hot-loop job", v) for k, v in res["workers"].items()]
    rows += [(f"{k} model ({v['job']['parameter_MB']} MB), 2 workers", v) for k, v in res["model_size"].items()]
    for name, v in rows:
        print(
            f"  {name:<40} steps/s ours {fmt(v['steps_per_s']['ours']['median'], 2):>7} baseline {fmt(v['steps_per_s']['baseline']['median'], 2):>7}"
            f"  ratio {fmt(v['ours/baseline steps_per_s'])}   ttfs ratio {fmt(v['ours/baseline ttfs'])}"
        )
    b = res.get("big_checkpoint_and_recovery")
    if b:
        print(
            f"  big model: checkpoint {b['checkpoint_bytes'] / 1e6:.0f} MB, sync save {fmt(b['sync_save_s'], 2)} s; "
            f"recovery {fmt(b['recovery_s'], 2)} s vs cold start {fmt(b['cold_ttfs_s'], 2)} s ({fmt(b['recovery/cold_ttfs'])})"
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", default="1,4", help="worker counts besides 2 (bench.hot_loop measures 2)")
    p.add_argument("--big-hidden", default="8192,8192")
    p.add_argument("--no-big-checkpoint", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="1 round: workers 1,4 and the big model, no tiny model, no checkpoint run"
    )
    p.add_argument("--tiny", action="store_true", help="1 round of a small 'big' model only (smoke test)")
    p.add_argument("--tiny-model", action="store_true", help="the tiny model's pair only, --rounds of it (section 7's row)")
    p.add_argument("--json", type=Path, default=RESULTS / "scaling.json")
    args = p.parse_args(argv)
    rounds, workers = args.rounds, [int(w) for w in args.workers.split(",") if w]
    big = dataclasses.replace(BIG, hidden=tuple(int(h) for h in args.big_hidden.split(",")))
    with_tiny, with_ckpt = True, not args.no_big_checkpoint
    if args.quick:
        rounds, with_tiny, with_ckpt = 1, False, False
    if args.tiny:  # one pair of a small "big" model
        rounds, workers, with_tiny, with_ckpt = 1, [], False, False
        big = dataclasses.replace(BIG, hidden=(256, 256), num_samples=256, workers=1)
    chosen: Optional[Job] = big
    if args.tiny_model:
        workers, chosen, with_tiny, with_ckpt = [], None, True, False
    log(f"scaling: workers {workers}, big model {big.hidden if chosen else None}, tiny model {with_tiny}, {rounds} round(s)")
    res = measure(rounds, workers, chosen, with_ckpt, with_tiny)
    out = {"benchmark": "scaling", "command": command_line("bench.scaling", argv), "machine": machine(), **res}
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
