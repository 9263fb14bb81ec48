"""Recovery: from the SIGKILL of one worker to the next completed training step after the automatic
resume, vs the cold time to first step, for several restart.monitor_interval values.

    python -m bench.recovery [--intervals 0.1,0.5,2,5] [--kills 2] [--default-kills 20] [--variant-kills 4] [--quick | --tiny] [--json PATH]

Each run is the tiny synthetic job with a checkpoint every 20 steps and the built-in fault
`fault=kill_rank fault.rank=1 fault.at_step=25 fault.times=K`: rank 1 SIGKILLs itself when it
completes step 25, K times over the run (the count survives restarts), so every restart resumes
from step 20 and is killed again at step 25 until K kills have fired. Recovery time of restart r
is the "first_step" event of restart r minus the "fault_fired" event that ended restart r-1
(written by the killed worker just before it kills itself). The cold time to first step is the
same run's first attempt, from just before the command's process was created.

The default interval's run has --default-kills kills (the 20-of-20 success figure). A restart
succeeds if the restarted group reaches a training step; the run must end with exit code 0 and
exactly K restarts (an extra restart is a failed rendezvous or a crash that was not injected).

All recovery runs are traced (bench/trace, opt-in): the trace splits each recovery into
detection (kill -> agent sees FAILED), agent restart (stop + rendezvous + start of the
workers), worker start-up (spawn, imports), init_process_group, model/DDP, checkpoint load and
the first step. The interval runs use the default start method (forkserver: restarted workers
fork from the server the first ones came from); variants at the default interval, each against
its own cold start: 'spawn' (backend.start_method=spawn: every restarted worker imports torch
again), 'fork' (backend.start_method=fork: copies of the launcher, fast but not safe) and 'disk'
(snapshot.every_n_steps=0: no snapshot in memory, every restart reads the checkpoint from disk; the
default restores from memory, and each run records where every restore came from).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import (
    RESULTS,
    TINY,
    Run,
    Workdir,
    command_line,
    fmt,
    log,
    machine,
    median,
    ratio,
    read_jsonl,
    restored_from,
    run_ours,
    sources_text,
    spread,
    write_json,
)

TARGET = ("<=", 0.25)
TARGET_MEMORY = ("<=", 0.15)  # a restore from the snapshot in memory (the default when the kill leaves host memory)
DEFAULT_INTERVAL = 0.5  # conf/restart/default.yaml
CKPT_EVERY, KILL_AT = 20, 25
JOB = dataclasses.replace(TINY, epochs=2)
VARIANTS = {
    "spawn": ["backend.start_method=spawn"],
    "fork": ["backend.start_method=fork"],
    "disk": ["snapshot.every_n_steps=0"],
}  # no snapshots in memory: every restart resumes from the disk checkpoint


def overrides(interval: float, kills: int, extra: List[str]) -> List[str]:
    return JOB.overrides() + [
        "checkpoint=every_n_steps",
        f"checkpoint.every_n_steps={CKPT_EVERY}",
        "fault=kill_rank",
        "fault.rank=1",
        f"fault.at_step={KILL_AT}",
        f"fault.times={kills}",
        f"restart.max_restarts={kills + 3}",
        f"restart.monitor_interval={interval}",
        *extra,
    ]


def _after(
    recs: List[Dict[str, Any]], what: str, since: float, until: float, pids: Optional[set] = None, last: bool = False
) -> Optional[float]:
    times = [r["t"] for r in recs if r["what"] == what and since < r["t"] <= until and (pids is None or r["pid"] in pids)]
    if not times:
        return None
    return max(times) if last else min(times)


def split_recovery(trace: List[Dict[str, Any]], launcher: int, kill: float, back: float) -> Dict[str, Optional[float]]:
    """Where one recovery's time went, from the trace (seconds)."""
    # the restarted group's workers: spawned by the launcher, or forked from it or from its forkserver
    new_workers = {
        r["pid"]
        for r in trace
        if r["pid"] != launcher
        and kill < r["t"] <= back
        and r["what"] in ("process", "worker_run_rank:start", "init_process_group:start")
    }
    marks = [
        ("detect (kill -> agent sees FAILED)", _after(trace, "agent_monitor:FAILED", kill, back, {launcher})),
        ("agent: stop workers, rendezvous", _after(trace, "agent_rendezvous:end", kill, back, {launcher})),
        (
            "workers: spawn + imports",
            _after(trace, "import:torch", kill, back, new_workers, last=True)
            or _after(trace, "worker_run_rank:start", kill, back, new_workers, last=True),
        ),
        ("workers: to init_process_group end", _after(trace, "init_process_group:end", kill, back, new_workers, last=True)),
        ("data + model + DDP init", _after(trace, "ddp_init:end", kill, back, new_workers, last=True)),
        ("checkpoint load (resume)", _after(trace, "trainer_resume:end", kill, back, new_workers, last=True)),
        ("first step", back),
    ]
    out: Dict[str, Optional[float]] = {}
    prev = kill
    for label, t in marks:
        if t is None:
            out[label] = None
            continue
        out[label] = t - prev
        prev = t
    return out


def analyse(run: Run, trace: List[Dict[str, Any]], kills: int) -> Dict[str, Any]:
    fired = sorted((e for e in run.events if e.get("event") == "fault_fired"), key=lambda e: e["time"])
    recoveries, parts = [], []
    for e in fired:
        r = int(e.get("restart", 0))
        back = run.first_step_time(r + 1)
        if back is None:
            continue
        recoveries.append(back - e["time"])
        if trace:
            parts.append(split_recovery(trace, run.pid, e["time"], back))
    restarts = max([int(e.get("restart", 0)) for e in run.events] or [0])
    resumed = [e.get("step") for e in run.events if e.get("event") == "resumed"]
    monitor = [r for r in trace if r["what"] == "agent_monitor:stats" and r["pid"] == run.pid]
    gaps = []  # per restart: seconds between the creation of the first and the last spawned worker
    for e in fired:
        created = sorted(
            r["created"]
            for r in trace
            if r["what"] == "process"
            and r.get("ppid") == run.pid
            and "--multiprocessing-fork" in r.get("argv", [])
            and r["created"] > e["time"]
        )[:2]
        if len(created) == 2:
            gaps.append(created[1] - created[0])
    payload = next((r["bytes"] for r in trace if r["what"] == "payload" and r["pid"] == run.pid), None)
    succeeded = len(recoveries)
    return {
        "kills": len(fired),
        "recovered": succeeded,
        "restarts": restarts,
        "exit_code": run.returncode,
        "all_succeeded": run.ok and len(fired) == kills and succeeded == kills and restarts == kills,
        "resumed_from_steps": sorted(set(resumed)),
        "restored_from": restored_from(run),
        "cold_ttfs_s": run.ttfs(),
        "recovery_s": recoveries,
        "recovery_median_s": median(recoveries),
        "split_median_s": {k: median([p[k] for p in parts]) for k in (parts[0] if parts else {})},
        # the median call: the mean is dominated by the few calls that collect exited or failed workers
        "agent_poll": {
            "calls": monitor[0]["calls"],
            "median_s_per_call": monitor[0].get("median_s"),
            "mean_s_per_call": monitor[0]["seconds"] / max(1, monitor[0]["calls"]),
        }
        if monitor
        else None,
        "wall_s": run.wall,
        "payload_bytes": payload,
        "workers_created_apart_median_s": median(gaps),
        "load": run.extra.get("load"),
    }


def one(work: Workdir, label: str, interval: float, kills: int, extra: List[str], timeout: float = 600) -> Dict[str, Any]:
    trace = work.path / f"trace-{label}-{work.count + 1}.jsonl"
    run = run_ours(work, label, overrides(interval, kills, extra), timeout, trace=trace)
    res = analyse(run, read_jsonl(trace), kills)
    res.update(monitor_interval=interval, variant=label)
    if not run.ok:
        res["output_tail"] = run.tail(2000)
    log(
        f"  {label:<16} interval {interval:<4} kills {res['kills']:>2} recovered {res['recovered']:>2} restarts {res['restarts']:>2}"
        f"  recovery median {fmt(res['recovery_median_s'], 2)} s  cold ttfs {fmt(res['cold_ttfs_s'], 2)} s  exit {run.returncode}"
    )
    return res


def measure(intervals: List[float], kills: int, default_kills: int, variants: bool, variant_kills: int = 4) -> Dict[str, Any]:
    results: List[Dict[str, Any]] = []
    with Workdir() as work:
        for interval in intervals:
            k = default_kills if interval == DEFAULT_INTERVAL else kills
            results.append(one(work, f"interval-{interval}", interval, k, []))
        for name, extra in VARIANTS.items() if variants else ():
            results.append(one(work, name, DEFAULT_INTERVAL, variant_kills, extra))
    cold_all = [r["cold_ttfs_s"] for r in results if r["variant"].startswith("interval-")]
    cold = median(cold_all)
    by_interval = {}
    for r in results:
        key = str(r["monitor_interval"]) if r["variant"].startswith("interval-") else f"{r['monitor_interval']} ({r['variant']})"
        own = r["variant"].startswith("interval-")
        by_interval[key] = {
            "recovery_median_s": r["recovery_median_s"],
            # interval runs: against the median cold start of all interval runs; a variant: against its own
            "recovery/cold_ttfs": ratio(r["recovery_median_s"], cold if own else r["cold_ttfs_s"]),
            "cold_ttfs_s": cold if own else r["cold_ttfs_s"],
            "succeeded": f"{r['recovered']}/{r['kills']}" + ("" if r["all_succeeded"] else " (run did not end cleanly)"),
            "detect_median_s": r["split_median_s"].get("detect (kill -> agent sees FAILED)"),
            "restored_from": r["restored_from"],
        }
    base = next((r for r in results if r["variant"] == f"interval-{min(intervals)}"), None)
    estimate_30 = None
    if base and base["recovery_median_s"] is not None:
        # The kill lands at a uniformly random phase of the agent's poll: mean detection delay = interval / 2.
        estimate_30 = base["recovery_median_s"] + (30 - base["monitor_interval"]) / 2
    return {
        "job": JOB.describe(),
        "checkpoint_every_n_steps": CKPT_EVERY,
        "kill_at_step": KILL_AT,
        "cold_ttfs_s": spread(cold_all),
        "runs": results,
        "summary": by_interval,
        "estimated_interval_30": {
            "recovery_s": estimate_30,
            "recovery/cold_ttfs": ratio(estimate_30, cold),
            "how": f"recovery at {min(intervals)} s + (30 - {min(intervals)})/2 s mean detection delay",
        },
    }


def report(res: Dict[str, Any]) -> None:
    print(f"\nRecovery (cold ttfs median {fmt(res['cold_ttfs_s']['median'], 2)} s over {res['cold_ttfs_s']['n']} runs)")
    print(f"  {'monitor_interval':<24}{'recovery s':>11}{'/cold':>8}{'detect s':>10}  succeeded  restored from")
    for k, v in res["summary"].items():
        print(
            f"  {k:<24}{fmt(v['recovery_median_s'], 2):>11}{fmt(v['recovery/cold_ttfs']):>8}{fmt(v['detect_median_s'], 2):>10}  {v['succeeded']:<9}  "
            + sources_text(v.get("restored_from"))
        )
    e = res["estimated_interval_30"]
    print(f"  {'30 (estimated)':<24}{fmt(e['recovery_s'], 2):>11}{fmt(e['recovery/cold_ttfs']):>8}")
    for r in res["runs"]:
        if r["split_median_s"]:
            print(
                f"  where the time goes ({r['variant']}): "
                + ", ".join(f"{k} {fmt(v, 2)}" for k, v in r["split_median_s"].items())
            )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals", default="0.1,0.5,2,5")
    p.add_argument("--kills", type=int, default=2, help="kills per run for the non-default intervals")
    p.add_argument("--variant-kills", type=int, default=4, help="kills in each start-method variant's run (spawn, fork)")
    p.add_argument(
        "--default-kills", type=int, default=20, help=f"kills in the run at the default interval ({DEFAULT_INTERVAL} s)"
    )
    p.add_argument("--no-variants", action="store_true")
    p.add_argument(
        "--quick", action="store_true", help="intervals 0.1,0.5,2 with 1 kill (20 at the default); spawn and fork with 2"
    )
    p.add_argument("--tiny", action="store_true", help="one run at the default interval with 1 kill (smoke test)")
    p.add_argument("--json", type=Path, default=RESULTS / "recovery.json")
    args = p.parse_args(argv)
    intervals = [float(x) for x in args.intervals.split(",")]
    kills, default_kills, variants = args.kills, args.default_kills, not args.no_variants
    if args.quick:
        intervals, kills, default_kills, args.variant_kills = [0.1, 0.5, 2.0], 1, 20, 2
    if args.tiny:
        intervals, kills, default_kills, variants = [DEFAULT_INTERVAL], 1, 1, False
    log(f"recovery: intervals {intervals}, {default_kills} kills at {DEFAULT_INTERVAL} s, {kills} elsewhere")
    res = measure(intervals, kills, default_kills, variants, args.variant_kills)
    res["target"] = {"recovery/cold_ttfs": TARGET, "recovery from memory/cold_ttfs": TARGET_MEMORY, "restarts succeeded": "20/20"}
    out = {"benchmark": "recovery", "command": command_line("bench.recovery", argv), "machine": machine(), **res}
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
