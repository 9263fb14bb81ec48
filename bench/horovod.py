"""Horovod against a hand-written Horovod script, and against torchrun, on the same job: training steps/s
and time to first step.

    python -m bench.horovod [--rounds 6] [--tuning | --variants NAME,...] [--no-torchrun] [--quick | --tiny] [--json PATH]

`python -m pipeline.train backend=horovod` (Horovod's runner, Gloo controller), bench/baseline_horovod.py
under `horovodrun -np 2 --gloo` (`hand_written`: hvd.DistributedOptimizer, broadcast_parameters and
broadcast_optimizer_state, batches sliced from the tensors; the target, ours >= 0.97x of it) and the
default torchrun backend (reported), alternated in a rotated order, on the hot-loop job
(bench.common.HOT with half its data); steps/s as in bench.hot_loop (median logged interval after
warm-up, epoch ends left out), time to first step from the command. Horovod settings are varied
through the launcher's environment (a value there wins over the backend's TUNING):
  horovod            the backend's defaults (HOROVOD_CYCLE_TIME=1 ms, HOROVOD_CACHE_CAPACITY=1024: Horovod's
                     own, which `horovodrun` leaves in place, so the hand-written script runs with them too)
  --tuning adds horovod_unpatched (cycle time 0 and no response cache: what the Python API horovod.run
  0.28.1, the backend's runner, hands its workers when nothing overrides it, its '(None,)' values parse
  as 0; the command-line horovodrun sets neither), cycle times of 0 (the cache kept), 0.2, 3 and 10 ms, no response cache (the cycle
  time kept) and tensor fusion off (HOROVOD_FUSION_THRESHOLD=0):
  the measurement the defaults were chosen from (see bench/NOTES.md; the workers' gradients go as
  one grouped all-reduce per step, steadfast.distributed._horovod, chosen the same way).
`--variants` adds only the named ones of those, or of the backend's settings with a part of the library
off: snapshot_off (snapshot=off), anomaly_off (anomaly=off); `--no-torchrun` leaves torchrun out (more
rounds of the Horovod comparison in the same time).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import (
    HOT,
    RESULTS,
    ROOT,
    Job,
    Run,
    Workdir,
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


def horovod_available() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # an ImportError, or a build without the torch extension
        return False
    return True


VARIANTS: Dict[str, Dict[str, str]] = {"horovod": {}}
TUNING_VARIANTS: Dict[str, Dict[str, str]] = {
    "horovod_unpatched": {"HOROVOD_CYCLE_TIME": "0", "HOROVOD_CACHE_CAPACITY": "0"},
    # each of horovod_unpatched's two settings alone (the other at the backend's value)
    "horovod_cycle_0": {"HOROVOD_CYCLE_TIME": "0"},
    "horovod_cache_0": {"HOROVOD_CACHE_CAPACITY": "0"},
    "horovod_cycle_0.2ms": {"HOROVOD_CYCLE_TIME": "0.2"},
    "horovod_cycle_3ms": {"HOROVOD_CYCLE_TIME": "3"},
    "horovod_cycle_10ms": {"HOROVOD_CYCLE_TIME": "10"},
    "horovod_no_fusion": {"HOROVOD_FUSION_THRESHOLD": "0"},
}
# the backend's Horovod settings with a part of the library's off (--variants): what that part costs under Horovod
CONFIG_VARIANTS: Dict[str, List[str]] = {"snapshot_off": ["snapshot=off"], "anomaly_off": ["anomaly=off"]}


def measure(
    job: Job,
    rounds: int,
    timeout: float = 300,
    variants: Optional[Dict[str, Dict[str, str]]] = None,
    torchrun: bool = True,
    overrides: Optional[Dict[str, List[str]]] = None,
) -> Dict[str, Any]:
    """`variants`: name -> the launcher's environment for it; `overrides`: name -> its extra config overrides."""
    warm = min(30, job.steps_per_epoch() // 2)
    extra = ["checkpoint.every_n_epochs=1000"]
    variants = VARIANTS if variants is None else variants
    with Workdir() as work:
        makers = (
            [("torchrun", lambda: run_ours(work, "torchrun", job.overrides() + extra, timeout, sample_cpu=True))]
            if torchrun
            else []
        )
        script = ROOT / "bench" / "baseline_horovod.py"
        makers.append(
            (
                "hand_written",
                lambda: run_baseline(
                    work, "horovod-baseline", job, timeout, sample_cpu=True, loader="slices", script=script, horovod=True
                ),
            )
        )
        makers += [
            (
                name,
                functools.partial(
                    run_ours,
                    work,
                    name,
                    job.overrides("horovod") + extra + (overrides or {}).get(name, []),
                    timeout,
                    sample_cpu=True,
                    extra_env=e,
                ),
            )
            for name, e in variants.items()
        ]

        def show(name: str, r: int, run: Run) -> None:
            check(run, f"horovod bench {name}")
            cpu = cpu_per_step(run, warm) or {}
            log(
                f"  round {r + 1} {name:<20} steps/s {fmt(steady_rate(run, warm), 1):>7}  CPU ms/step "
                f"{fmt((cpu.get('total_cpu_s_per_step') or 0) * 1e3, 2)}  ttfs {fmt(run.ttfs(), 2)} s  wall {run.wall:.1f} s"
            )

        runs = alternate(rounds, makers, show)
    rates = {k: [steady_rate(r, warm) for r in v] for k, v in runs.items()}
    cpu = {k: [(cpu_per_step(r, warm) or {}).get("total_cpu_s_per_step") for r in v] for k, v in runs.items()}
    ttfs = {k: [r.ttfs() for r in v] for k, v in runs.items()}
    out: Dict[str, Any] = {
        "job": job.describe(),
        "rounds": rounds,
        "warmup_steps": warm,
        "variants": variants,
        "variant_overrides": overrides or {},
        "steps_per_s": {k: spread(v) for k, v in rates.items()},
        "cpu_s_per_step": {k: spread(v) for k, v in cpu.items()},
        "ttfs_s": {k: spread(v) for k, v in ttfs.items()},
        "wall_s": {k: spread([r.wall for r in v]) for k, v in runs.items()},
        "foreign_load": {k: foreign(v) for k, v in runs.items()},
        "ratios": {},
    }

    def against(base: str) -> None:
        """Each variant's steps/s over `base`'s: ratio of the medians, median of the paired rounds, per CPU-second."""
        for name in variants:
            out["ratios"].update(
                {
                    f"{name}/{base} steps_per_s": ratio(median(rates[name]), median(rates[base])),
                    f"{name}/{base} steps_per_s (median of paired rounds)": median(
                        [ratio(v, b) for v, b in zip(rates[name], rates[base])]
                    ),
                    f"{name}/{base} steps per CPU-second": ratio(median(cpu[base]), median(cpu[name])),
                }
            )

    against("hand_written")
    if "horovod" in variants:
        out["ratios"]["horovod/hand_written ttfs"] = ratio(median(ttfs["horovod"]), median(ttfs["hand_written"]))
    if torchrun:
        against("torchrun")
        if "horovod" in variants:
            out["ratios"].update(
                {
                    "horovod/torchrun ttfs": ratio(median(ttfs["horovod"]), median(ttfs["torchrun"])),
                    "horovod/torchrun wall": ratio(
                        median([r.wall for r in runs["horovod"]]), median([r.wall for r in runs["torchrun"]])
                    ),
                }
            )
    return out


def report(res: Dict[str, Any]) -> None:
    if res.get("skipped"):
        print(f"\nHorovod: skipped ({res['skipped']})")
        return
    print(f"\nHorovod vs the hand-written script and torchrun ({res['rounds']} rounds)")
    for k in res["steps_per_s"]:
        print(
            f"  {k:<20} steps/s {fmt(res['steps_per_s'][k]['median'], 1)}  ttfs {fmt(res['ttfs_s'][k]['median'], 2)} s"
            f"  wall {fmt(res['wall_s'][k]['median'], 1)} s"
        )
    for k, v in res["ratios"].items():
        print(f"  {k:<55} {fmt(v)}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tuning", action="store_true", help="also Horovod's own defaults, cycle times, tensor fusion off")
    p.add_argument("--variants", default="", help=f"comma-separated, of: {', '.join([*TUNING_VARIANTS, *CONFIG_VARIANTS])}")
    p.add_argument("--no-torchrun", action="store_true", help="leave the torchrun backend out")
    p.add_argument("--quick", action="store_true", help="2 rounds of a job with a quarter of the data")
    p.add_argument(
        "--tiny", action="store_true", help="one Horovod run and one hand-written of a tiny job, no torchrun (smoke test)"
    )
    p.add_argument("--json", type=Path, default=RESULTS / "horovod.json")
    args = p.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(TUNING_VARIANTS) - set(CONFIG_VARIANTS))
    if unknown:
        p.error(f"--variants: {', '.join(unknown)} unknown; allowed: {', '.join([*TUNING_VARIANTS, *CONFIG_VARIANTS])}")
    job, rounds = dataclasses.replace(HOT, num_samples=HOT.num_samples // 2), args.rounds
    if args.quick:
        job, rounds = dataclasses.replace(HOT, num_samples=HOT.num_samples // 4), 2
    if args.tiny:
        # 2 workers: with backend.np=1 Horovod 0.28.1 fails in the runner (log10(0) in gloo_run._pad_rank with an output folder)
        job, rounds = dataclasses.replace(HOT, num_samples=1024, num_features=16, hidden=(16,), epochs=1, log_every=2), 1
    out: Dict[str, Any] = {"benchmark": "horovod", "command": command_line("bench.horovod", argv), "machine": machine()}
    if not horovod_available():
        out["skipped"] = "horovod.torch cannot be imported (STEADFAST_WITHOUT_HOROVOD=1 setup?)"
    else:
        log(f"horovod vs hand-written and torchrun: {rounds} rounds")
        variants = {"horovod": {}} if args.tiny else {**VARIANTS, **(TUNING_VARIANTS if args.tuning else {})}
        variants.update({name: TUNING_VARIANTS.get(name, {}) for name in chosen})
        overrides = {name: CONFIG_VARIANTS[name] for name in chosen if name in CONFIG_VARIANTS}
        out.update(measure(job, rounds, variants=variants, torchrun=not (args.tiny or args.no_torchrun), overrides=overrides))
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
