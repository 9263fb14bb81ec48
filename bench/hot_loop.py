"""Hot loop: training steps/s of `python -m pipeline.train` vs the hand-written DDP baseline, and
what checkpointing every N steps (sync and async) costs.

    python -m bench.hot_loop [--rounds 3] [--every 20] [--quick | --tiny] [--json PATH]

Same job on both sides (bench.common.HOT: synthetic data, 256 features, MLP 512-512, batch 64 per
worker, 2 workers, Gloo). The runs alternate in a rotated order each round; the median of each
is reported. Steps/s comes from the logged steps (metrics.jsonl rows and the baseline's rows,
every 10 steps), after 30 warm-up steps, leaving out intervals that span an epoch end (the
trainer validates there) and, for the hot-loop figure, intervals holding a checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .common import (HOT, RESULTS, Job, Run, Workdir, check, foreign, aborted_at_exit, command_line, fmt, log, machine, median, ratio,
                     run_baseline, run_ours, spread, steady_rate, write_json)

TARGET = (">=", 0.99)


def ours_overrides(job: Job, mode: str, every: int, extra: Sequence[str] = ()) -> List[str]:
    base = job.overrides() + list(extra)
    if mode == "none":  # no checkpoint until the end of the run
        return base + ["checkpoint.every_n_epochs=1000"]
    ck = ["checkpoint=every_n_steps", f"checkpoint.every_n_steps={every}"]
    return base + ck + (["checkpoint.async_save=true"] if mode == "async" else [])


def save_costs(run: Run) -> Dict[str, Optional[float]]:
    saved = [e["seconds"] for e in run.events if e.get("event") == "checkpoint_saved" and "seconds" in e]
    blocked = [e["blocked_seconds"] for e in run.events if e.get("event") == "checkpoint_snapshot"]
    return {"save_seconds_median": median(saved), "snapshot_blocked_seconds_median": median(blocked), "saves": len(saved)}


def measure(job: Job, rounds: int, every: int, ckpt_rounds: int = 2, timeout: float = 300,
            extra: Sequence[str] = (), work: Optional[Workdir] = None) -> Dict[str, Any]:
    """Alternate baseline and ours `rounds` times; the checkpoint runs join the first `ckpt_rounds` rounds."""
    own = work is None
    work = work or Workdir()
    warm = min(30, job.steps_per_epoch() // 2)
    makers = {"baseline": lambda: run_baseline(work, "baseline", job, timeout),
              "ours": lambda: run_ours(work, "ours", ours_overrides(job, "none", every, extra), timeout),
              "ours_sync_ckpt": lambda: run_ours(work, "sync", ours_overrides(job, "sync", every, extra), timeout),
              "ours_async_ckpt": lambda: run_ours(work, "async", ours_overrides(job, "async", every, extra), timeout)}
    runs: Dict[str, List[Run]] = {k: [] for k in (makers if ckpt_rounds else ["baseline", "ours"])}
    try:
        for r in range(rounds):
            names = [k for k in runs if r < ckpt_rounds or not k.endswith("_ckpt")]
            names = names[r % len(names):] + names[: r % len(names)]  # rotated order
            for name in names:
                run = makers[name]()
                check(run, f"hot loop {name}")
                runs[name].append(run)
                log(f"  round {r + 1} {name:<16} steps/s {fmt(steady_rate(run, warm), 1):>7} (median interval)"
                    f"  {fmt(steady_rate(run, warm, False, 'mean'), 1):>7} (mean, all)  ttfs {fmt(run.ttfs(), 2)} s  wall {run.wall:.1f} s")
    finally:
        if own:
            work.close()
    clean = {k: [steady_rate(r, warm) for r in v] for k, v in runs.items()}
    mean_all = {k: [steady_rate(r, warm, False, "mean") for r in v] for k, v in runs.items()}
    # Within one run: everything (checkpoints, bursts of load) over the undisturbed speed.
    kept = {k: [ratio(a, c) for a, c in zip(mean_all[k], clean[k])] for k in runs}
    base, ours = median(clean["baseline"]), median(clean["ours"])
    out: Dict[str, Any] = {
        "job": job.describe(),
        "rounds": rounds,
        "checkpoint_rounds": ckpt_rounds,
        "warmup_steps": warm,
        "steps_per_s (median interval)": {k: spread(v) for k, v in clean.items()},
        "steps_per_s (mean over all intervals)": {k: spread(v) for k, v in mean_all.items()},
        "mean/median within run": {k: spread(v) for k, v in kept.items()},
        "ttfs_s": {k: spread([r.ttfs() for r in v]) for k, v in runs.items()},
        "foreign_load": {k: foreign(v) for k, v in runs.items()},
        "baseline_aborted_at_exit": aborted_at_exit(runs["baseline"]),
        "ratios": {
            "ours/baseline steps_per_s": ratio(ours, base),
            "ours/baseline steps_per_s (median of paired rounds)": median(
                [ratio(o, b) for o, b in zip(clean["ours"], clean["baseline"])]),
            "ours/baseline steps_per_s (mean over all intervals)": ratio(median(mean_all["ours"]), median(mean_all["baseline"])),
        },
    }
    if ckpt_rounds:
        per_save = {k: [save_costs(r) for r in runs[k]] for k in ("ours_sync_ckpt", "ours_async_ckpt")}
        sync_cost = median([c["save_seconds_median"] for c in per_save["ours_sync_ckpt"]])
        async_blocked = median([c["snapshot_blocked_seconds_median"] for c in per_save["ours_async_ckpt"]])
        async_total = median([c["save_seconds_median"] for c in per_save["ours_async_ckpt"]])
        noise = median(kept["ours"])
        out["checkpoint_every_n_steps"] = every
        out["checkpoint_costs"] = {"sync_save_seconds": sync_cost, "async_blocked_seconds": async_blocked,
                                   "async_save_to_commit_seconds": async_total, "runs": per_save}
        out["ratios"].update({
            f"sync ckpt every {every} steps / no ckpt steps_per_s": ratio(median(kept["ours_sync_ckpt"]), noise),
            f"async ckpt every {every} steps / no ckpt steps_per_s": ratio(median(kept["ours_async_ckpt"]), noise),
            f"sync ckpt every {every} steps / no ckpt steps_per_s (across runs)": ratio(median(mean_all["ours_sync_ckpt"]), median(mean_all["ours"])),
            f"async ckpt every {every} steps / no ckpt steps_per_s (across runs)": ratio(median(mean_all["ours_async_ckpt"]), median(mean_all["ours"])),
        })
        # The same per-save cost at the project's default cadence (every 10 epochs).
        if sync_cost and ours:
            default_every = 10 * job.steps_per_epoch()
            out["projected"] = {
                "default_cadence_steps": default_every,
                "sync ckpt every 10 epochs / no ckpt steps_per_s": 1 / (1 + sync_cost * ours / default_every),
                "async ckpt every 10 epochs / no ckpt steps_per_s": 1 / (1 + (async_blocked or 0) * ours / default_every),
            }
    return out


def report(res: Dict[str, Any]) -> None:
    print(f"\nHot loop ({res['rounds']} rounds, job {res['job']['hidden']} x{res['job']['workers']} workers)")
    for k, v in res["steps_per_s (median interval)"].items():
        print(f"  {k:<18} steps/s median {fmt(v['median'], 1)}  (min {fmt(v['min'], 1)}, max {fmt(v['max'], 1)})")
    for k, v in res["ratios"].items():
        print(f"  {k:<55} {fmt(v)}")
    if "projected" in res:
        for k, v in res["projected"].items():
            print(f"  projected {k:<45} {fmt(v) if isinstance(v, float) else v}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of baseline vs ours")
    p.add_argument("--ckpt-rounds", type=int, default=2, help="rounds that also run the sync and async checkpoint variants")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (the every_n_steps option's default)")
    p.add_argument("--quick", action="store_true", help="2 rounds (1 with checkpoints), 3 epochs")
    p.add_argument("--tiny", action="store_true", help="1 round of a tiny job, no checkpoint variants (smoke test)")
    p.add_argument("--json", type=Path, default=RESULTS / "hot_loop.json")
    args = p.parse_args(argv)
    job, rounds, ckpt_rounds = HOT, args.rounds, args.ckpt_rounds
    if args.quick:
        job, rounds, ckpt_rounds = dataclasses.replace(HOT, epochs=3), 2, 1
    if args.tiny:
        job, rounds, ckpt_rounds = dataclasses.replace(HOT, num_samples=1024, num_features=16, hidden=(16,), epochs=2, log_every=2), 1, 0
    if args.epochs:
        job = dataclasses.replace(job, epochs=args.epochs)
    log(f"hot loop: {rounds} rounds of baseline / ours, {ckpt_rounds} with ours+sync ckpt / ours+async ckpt")
    res = measure(job, rounds, args.every if not args.tiny else 4, ckpt_rounds)
    res["target"] = {"ours/baseline steps_per_s": TARGET}
    out = {"benchmark": "hot_loop", "command": command_line("bench.hot_loop", argv), "machine": machine(), **res}
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
