"""Goodput under failure: a fixed amount of training with a worker SIGKILLed every T seconds.

    python -m bench.goodput [--periods 30,10] [--train-s 35,20] [--quick | --tiny] [--json PATH]

The job is the hot-loop model with epochs of ~1 s (bench.goodput.JOB) and as many epochs as make --train-s seconds of
failure-free training for each period T. First a failure-free reference run (10 epochs, a sync
checkpoint every 50 steps) measures the failure-free training speed r (steps over training
time, validation included, checkpoint time left out) and the cost C of one sync save (the
"seconds" of its checkpoint_saved events). Then, for each T, runs with the default restart policy
and these checkpoint cadences, all with the default snapshots in memory (snapshot.every_n_steps=auto:
a restart after a worker's death resumes from the newest snapshot): the project's default (every
10 epochs); at T <= 10 s also checkpoint.every_n_seconds=auto without snapshots in memory
(snapshot.every_n_steps=0: what the memory tier is worth); checkpoint.every_n_seconds=auto
(the library picks Young/Daly's interval from the save cost it measures and the failures it has
seen, with its floors; the intervals it chose are reported from its checkpoint_interval events);
and the Young/Daly interval tau = sqrt(2 * C * T) computed here from the reference C and the
known T (checkpoint.every_n_seconds=tau: what auto aims at, without floors). From the first training step on, the
benchmark SIGKILLs the newest worker process (rank 1 unless a restart is half-way) every T
seconds until the run ends; a run that has not ended by --cap-factor x its failure-free time
(+15 s) is stopped and scored by the progress it had committed.

  useful time   = steps trained (or committed, if stopped) / the run's own failure-free speed: its
                  median logged 5-step interval, slowed by the reference run's ratio of training
                  time (validation included) to pure step time (other tenants' load differs from
                  run to run, so the reference run's absolute speed would not do)
  goodput       = useful time / wall time from the first training step to the end of training
                  (the one cold start is left out: it does not depend on failures; see startup)
  goodput incl. start = useful time / wall time from the command
  recomputed steps per failure = step reached at the kill (from the logged steps) - step resumed from
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import (
    HOT,
    RESULTS,
    Job,
    Run,
    Workdir,
    command_line,
    finish_ours,
    fmt,
    log,
    machine,
    median,
    read_jsonl,
    restored_from,
    run_ours,
    start_ours,
    steady_rate,
)

TARGET = (">=", 0.92, 30)  # goodput at T = 30 s
AUTO = "auto (checkpoint.every_n_seconds=auto)"
DISK_ONLY = "disk only, auto (snapshot.every_n_steps=0)"
MEMORY_TARGET = (">=", 0.90, 10)  # goodput at T = 10 s with the default cadences (snapshots in memory on)
# The hot-loop model and data shape with epochs of ~1 s (103 steps), so the default cadence (every 10 epochs) is ~10 s.
JOB = dataclasses.replace(HOT, num_samples=16384)
LOG_EVERY = 5


def worker_pids(launcher: int) -> List[int]:
    """The launcher's worker processes, newest last: its children (spawned or forked workers), or the
    children of its forkserver (the default start method); not its resource tracker or forkserver."""
    procs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if fields[0] == "Z":
                continue
            procs.append((int(entry.name), int(fields[1]), int(fields[19]), (entry / "cmdline").read_bytes()))
        except (OSError, ValueError, IndexError):
            continue
    helpers = {
        pid
        for pid, parent, _, cmd in procs
        if parent == launcher and (b"resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd)
    }
    found = [(start, pid) for pid, parent, start, _ in procs if (parent == launcher and pid not in helpers) or parent in helpers]
    return [pid for _, pid in sorted(found)]


class Killer(threading.Thread):
    """SIGKILLs the newest worker every `period` seconds from the first training step on."""

    def __init__(self, launcher: int, folder: Path, period: float, max_kills: Optional[int] = None) -> None:
        super().__init__(daemon=True)
        self.launcher, self.folder, self.period, self.max_kills = launcher, folder, period, max_kills
        self.stop = threading.Event()
        self.kills: List[Dict[str, Any]] = []

    def _first_step(self) -> Optional[float]:
        for e in read_jsonl(self.folder / "events.jsonl"):
            if e.get("event") == "first_step":
                return float(e["time"])
        return None

    def run(self) -> None:
        first = None
        while first is None and not self.stop.wait(0.05):
            first = self._first_step()
        k = 1
        while (
            first is not None
            and (self.max_kills is None or k <= self.max_kills)
            and not self.stop.wait(max(0.0, first + k * self.period - time.time()))
        ):
            while not self.stop.is_set():
                pids = worker_pids(self.launcher)
                if pids:
                    try:
                        os.kill(pids[-1], signal.SIGKILL)
                        self.kills.append({"time": time.time(), "pid": pids[-1], "scheduled": first + k * self.period})
                        break
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)
            k += 1


def timed_run(
    work: Workdir, label: str, overrides: List[str], period: Optional[float], cap: float, max_kills: Optional[int] = None
) -> Run:
    proc, started, folder = start_ours(work, work.name(label), overrides)
    counters = work.counters
    killer = None
    if period:
        killer = Killer(proc.pid, folder, period, max_kills)
        killer.start()
    run = finish_ours(proc, started, folder, timeout=cap, counters=counters)
    if killer:
        killer.stop.set()
        killer.join(5)
        run.extra["kills"] = killer.kills
    run.extra["stopped_at_cap"] = run.returncode is None
    return run


def reference(work: Workdir, job: Job) -> Dict[str, Any]:
    ref_job = dataclasses.replace(job, epochs=10)
    run = run_ours(work, "reference", ref_job.overrides() + ["checkpoint=every_n_steps", "checkpoint.every_n_steps=50"])
    if not run.ok:
        raise RuntimeError(f"goodput reference run failed:\n{run.tail()}")
    saves = [float(e["seconds"]) for e in run.events if e.get("event") == "checkpoint_saved"]
    done = next(e for e in run.events if e.get("event") == "training_completed")
    first = run.first_step_time()
    assert first is not None
    steps = int(done["step"]) - 1  # the first step ends at `first`
    rate = steps / (float(done["time"]) - first - sum(saves[:-1]))  # the final save is after the last step
    step_rate = steady_rate(run, 10)  # the median logged interval: steps only, no validation, no saves
    return {
        "steps_per_s": rate,
        "step_only_steps_per_s": step_rate,
        # training time (validation included) over pure step time: turns a run's own step speed into its useful speed
        "validation_factor": (step_rate / rate) if step_rate else 1.0,
        "save_cost_s": median(saves),
        "saves": len(saves),
        "ttfs_s": run.ttfs(),
        "wall_s": run.wall,
    }


def analyse(run: Run, rate: float, total_steps: int, validation_factor: float = 1.0) -> Dict[str, Any]:
    first = run.first_step_time()
    events = run.events
    done = [e for e in events if e.get("event") == "training_completed"]
    kills = run.extra.get("kills", [])
    restarts = max([int(e.get("restart", 0)) for e in events] or [0])
    rows = sorted((m for m in run.step_rows()), key=lambda m: m["time"])
    if done:
        end, steps = float(done[-1]["time"]), int(done[-1]["step"])
    else:  # stopped at the cap: count what was committed
        end = run.started + run.wall
        saved = [int(e["step"]) for e in events if e.get("event") == "checkpoint_saved"]
        steps = max(saved or [0])
    firsts = sorted(float(e["time"]) for e in events if e.get("event") == "first_step")
    resumes = sorted((float(e["time"]), int(e["step"])) for e in events if e.get("event") == "resumed")
    kill_times = sorted(k["time"] for k in kills)
    per_failure = []
    for i, kill in enumerate(kill_times):
        back = next((t for t in firsts if t > kill), None)
        later = kill_times[i + 1] if i + 1 < len(kill_times) else math.inf
        if back is not None and later < back:
            per_failure.append({"kill": kill, "during_recovery": True})  # the next kill came before a step
            continue
        since = max([t for t in firsts if t <= kill] or [first or kill])
        before = [m for m in rows if since <= m["time"] <= kill]
        # the resume of the attempt that followed the kill; none before its first step: it started from scratch
        resumed_from = next((st for t, st in resumes if kill < t <= back), 0) if back is not None else None
        reached = None
        if before:
            reached = before[-1]["step"] + min(LOG_EVERY, int((kill - before[-1]["time"]) * rate))
        elif resumed_from is not None:
            reached = resumed_from  # killed before this attempt logged a step
        per_failure.append(
            {
                "kill": kill,
                "recovery_s": (back - kill) if back else None,
                "resumed_from": resumed_from,
                "reached": reached,
                "recomputed_steps": (reached - resumed_from) if reached is not None and resumed_from is not None else None,
            }
        )
    # Useful time at this run's own failure-free speed (other tenants' load changes from run to run):
    # its median logged interval, scaled by the reference run's validation factor.
    own = steady_rate(run, 10)
    own_rate = own / validation_factor if own else rate
    useful = steps / own_rate
    wall = end - first if first else None
    saves = [float(e["seconds"]) for e in events if e.get("event") == "checkpoint_saved"]
    return {
        "finished": bool(done),
        "exit_code": run.returncode,
        "steps": steps,
        "of_steps": total_steps,
        "kills": len(kills),
        "restarts": restarts,
        "checkpoints": len(saves),
        "checkpoint_s_total": sum(saves),
        "useful_s": useful,
        "own_steps_per_s": own_rate,
        "wall_from_first_step_s": wall,
        "wall_from_command_s": end - run.started,
        "goodput": useful / wall if wall else None,
        "goodput_incl_start": useful / (end - run.started),
        "recovery_median_s": median([f.get("recovery_s") for f in per_failure]),
        "recomputed_steps_median": median([f.get("recomputed_steps") for f in per_failure]),
        "recomputed_s_median": (median([f.get("recomputed_steps") for f in per_failure]) or 0) / rate if per_failure else None,
        "failures": per_failure,
        "load": run.extra.get("load"),
    }


def predicted(rate_tau_s: float, cost: float, recovery: float, period: float) -> float:
    """First-order model: (1 - checkpoint overhead) x (1 - time lost per failure / T)."""
    return (1 / (1 + cost / rate_tau_s)) * max(0.0, 1 - (recovery + rate_tau_s / 2) / period)


def measure(
    periods: List[float],
    train_s: List[float],
    cap_factor: float,
    job: Job = JOB,
    given: Optional[Dict[str, Any]] = None,
    cadences_wanted: str = "all",
    max_kills: Optional[int] = None,
    skip_default_below: Optional[float] = None,
) -> Dict[str, Any]:
    job = dataclasses.replace(job, log_every=LOG_EVERY)
    out: Dict[str, Any] = {"job": job.describe(), "periods_s": periods}
    with Workdir() as work:
        ref = dict(given) if given else reference(work, job)
        out["reference"] = ref
        rate, cost = ref["steps_per_s"], ref["save_cost_s"] or 0.0
        epoch_s = job.steps_per_epoch() / rate
        log(f"  reference: {rate:.1f} steps/s, sync save {fmt(cost, 4)} s, epoch {epoch_s:.2f} s")
        out["default_cadence"] = {"every_n_epochs": 10, "seconds_of_training": 10 * epoch_s}
        results = []
        for period, seconds in zip(periods, train_s):
            epochs = max(2, math.ceil(seconds * rate / job.steps_per_epoch()))
            run_job = dataclasses.replace(job, epochs=epochs)
            total = epochs * job.steps_per_epoch()
            tau = math.sqrt(2 * cost * period) if cost else None
            cadences = [
                ("default (every 10 epochs)", ["checkpoint.every_n_epochs=10"], 10 * epoch_s),
                (AUTO, ["checkpoint.every_n_epochs=null", "checkpoint.every_n_seconds=auto"], None),
            ]
            if period <= MEMORY_TARGET[2]:  # what the memory tier is worth: the same without it
                cadences.append(
                    (
                        DISK_ONLY,
                        ["checkpoint.every_n_epochs=null", "checkpoint.every_n_seconds=auto", "snapshot.every_n_steps=0"],
                        None,
                    )
                )
            if tau:
                cadences.append(
                    (
                        f"Young/Daly (every {tau:.2f} s)",
                        ["checkpoint.every_n_epochs=null", f"checkpoint.every_n_seconds={tau:.3f}"],
                        tau,
                    )
                )
            if cadences_wanted != "all":
                cadences = [c for c in cadences if c[0].split(" ")[0].lower().startswith(cadences_wanted)]
            elif skip_default_below and period < skip_default_below and len(cadences) > 1:
                cadences = [c for c in cadences if not c[0].startswith("Young")]  # --quick: short periods without the fixed tau
            for name, ck, interval in cadences:
                overrides = run_job.overrides() + ck + ["restart.max_restarts=1000"]
                run = timed_run(work, f"T{period:g}", overrides, period, cap=cap_factor * seconds + 15, max_kills=max_kills)
                res = analyse(run, rate, total, ref.get("validation_factor", 1.0))
                res["restored_from"] = restored_from(run)
                chosen = [float(e["seconds"]) for e in run.events if e.get("event") == "checkpoint_interval"]
                if interval is None:  # auto: the intervals the library chose (the last one governs the steady state)
                    res["auto_intervals_s"] = chosen
                    interval = chosen[-1] if chosen else None
                res.update(
                    period_s=period,
                    cadence=name,
                    checkpoint_interval_s=interval,
                    epochs=epochs,
                    failure_free_train_s=seconds,
                    predicted_goodput=predicted(interval, cost, res["recovery_median_s"] or 0.0, period) if interval else None,
                )
                results.append(res)
                log(
                    f"  T={period:g}s {name:<40} goodput {fmt(res['goodput'])} (predicted {fmt(res['predicted_goodput'])})"
                    f"  kills {res['kills']}  recomputed/failure {fmt(res['recomputed_steps_median'], 0)} steps"
                    f"  recovery {fmt(res['recovery_median_s'], 2)} s  {'finished' if res['finished'] else 'STOPPED at cap'}"
                )
    out["runs"] = results
    out["young_daly"] = {
        f"T={p:g}": {"interval_s": math.sqrt(2 * cost * p) if cost else None, "formula": "sqrt(2 * save cost * MTBF)"}
        for p in periods
    }
    return out


def report(res: Dict[str, Any]) -> None:
    ref = res["reference"]
    print(
        f"\nGoodput (failure-free {ref['steps_per_s']:.1f} steps/s, sync save {fmt(ref['save_cost_s'], 4)} s,"
        f" default cadence = {res['default_cadence']['seconds_of_training']:.1f} s of training)"
    )
    print(
        f"  {'T':>4}  {'cadence':<40}{'goodput':>8}{'incl.start':>11}{'predicted':>10}{'kills':>6}{'recomp.':>8}{'recovery':>9}"
    )
    for r in res["runs"]:
        print(
            f"  {r['period_s']:>4g}  {r['cadence']:<40}{fmt(r['goodput']):>8}{fmt(r['goodput_incl_start']):>11}"
            f"{fmt(r['predicted_goodput']):>10}{r['kills']:>6}{fmt(r['recomputed_steps_median'], 0):>8}{fmt(r['recovery_median_s'], 2):>9}"
            + ("" if r["finished"] else "  (stopped at the cap)")
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--periods", default="30,10", help="seconds between kills")
    p.add_argument("--train-s", default="45,20", help="failure-free training seconds for each period")
    p.add_argument(
        "--cap-factor", type=float, default=1.75, help="stop a run after this many times its failure-free time (+15 s)"
    )
    p.add_argument(
        "--quick", action="store_true", help="T=30 with 40 s of training; T=10 with 15 s, without the fixed Young/Daly cadence"
    )
    p.add_argument(
        "--tiny", action="store_true", help="one run of a tiny job, one kill (smoke test; reference figures given, not measured)"
    )
    p.add_argument("--json", type=Path, default=RESULTS / "goodput.json")
    args = p.parse_args(argv)
    periods = [float(x) for x in args.periods.split(",")]
    train_s = [float(x) for x in args.train_s.split(",")]
    job = JOB
    given, cadences, max_kills, skip_default_below = None, "all", None, None
    if args.quick:
        train_s, skip_default_below = [40.0, 15.0], 15.0
    if args.tiny:  # one run, one kill: the reference figures are given, not measured
        periods, train_s, cadences, max_kills = [1.0], [2.0], "auto", 1
        # a smoke test: it must finish on a slow or busy machine (the tests' timeout is 150 s), not be timed
        args.cap_factor = max(args.cap_factor, 45.0)
        job = dataclasses.replace(HOT, num_samples=2048, num_features=32, hidden=(64, 64), batch_size=32)
        given = {"steps_per_s": 250.0, "save_cost_s": 0.01, "note": "given, not measured (--tiny)"}
    log(f"goodput: kill every {periods} s, {train_s} s of failure-free training")
    res = measure(periods, train_s, args.cap_factor, job, given, cadences, max_kills, skip_default_below)
    res["target"] = {
        "goodput at T=30 (auto cadence)": TARGET[:2],
        "goodput at T=10 (default cadences, snapshots in memory)": MEMORY_TARGET[:2],
    }
    out = {"benchmark": "goodput", "command": command_line("bench.goodput", argv), "machine": machine(), **res}
    report(out)
    from .common import write_json

    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
