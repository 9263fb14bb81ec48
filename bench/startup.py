"""Time to first step: `python -m pipeline.train` vs `torchrun --standalone --nproc_per_node 2` on the
hand-written baseline, for each worker start method, and where our time goes.

    python -m bench.startup [--rounds 3] [--traced 1] [--quick | --tiny] [--json PATH]

Time to first step (TTFS) is measured from just before the command's process is created to the
wall-clock time of the first completed training step (the trainer's "first_step" event; the
baseline writes its own). The tiny synthetic job, so start-up is not diluted by work. The
untraced runs, alternated in a rotated order, give the headline ratios:
  ours        the default (backend.start_method=forkserver: workers fork from a server that
              imported torch, DDP's imports and the library once, in parallel with the launcher)
  ours_spawn  backend.start_method=spawn: every worker is a new interpreter that imports torch
  ours_fork   backend.start_method=fork: workers are copies of the launcher (fast, not safe:
              the launcher has threads)

The breakdown comes from separate traced runs: bench/trace/sitecustomize.py (opt-in, on
PYTHONPATH only for those runs) records when each process was created, when watched modules
finish importing and when the launcher's, the agent's and the library's steps start and end.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .common import (
    RESULTS,
    TINY,
    Job,
    Run,
    Workdir,
    aborted_at_exit,
    alternate,
    check,
    command_line,
    fmt,
    foreign,
    log,
    machine,
    median,
    ratio,
    read_jsonl,
    run_baseline,
    run_ours,
    spread,
    write_json,
)

TARGET = ("<=", 1.10)
START_METHODS = {"ours": [], "ours_spawn": ["backend.start_method=spawn"], "ours_fork": ["backend.start_method=fork"]}


def ours_overrides(job: Job) -> List[str]:
    return job.overrides() + ["checkpoint.every_n_epochs=1000"]


# ---- the breakdown ------------------------------------------------------------------------------
def _by_pid(trace: List[Dict[str, Any]]) -> Dict[int, List[Dict[str, Any]]]:
    out: Dict[int, List[Dict[str, Any]]] = {}
    for r in trace:
        out.setdefault(r["pid"], []).append(r)
    return out


def _first(recs: List[Dict[str, Any]], what: str, key: str = "t") -> Optional[float]:
    for r in recs:
        if r["what"] == what:
            return float(r[key])
    return None


def _total(recs: List[Dict[str, Any]], what: str) -> Tuple[float, int]:
    durations = [r["t"] - r["start"] for r in recs if r["what"] == what and "start" in r]
    return sum(durations), len(durations)


def worker_records(trace: List[Dict[str, Any]], launcher_pid: int) -> Dict[int, List[Dict[str, Any]]]:
    """Every worker's records: the processes that initialised a process group (spawned by the launcher,
    forked from its forkserver, or forked from it)."""
    return {
        pid: recs
        for pid, recs in _by_pid(trace).items()
        if pid != launcher_pid and any(r["what"] == "init_process_group:start" for r in recs)
    }


def _started(recs: List[Dict[str, Any]]) -> float:
    """When a worker process was created (spawned), else its first record (forked: it starts in its parent's state)."""
    return float(recs[0]["created"]) if recs[0]["what"] == "process" else float(recs[0]["t"])


def forkserver_records(trace: List[Dict[str, Any]], launcher_pid: int) -> List[Dict[str, Any]]:
    """The records of the launcher's forkserver (the parent of its workers, when that is not the launcher)."""
    parents = {recs[0]["ppid"] for recs in worker_records(trace, launcher_pid).values()} - {launcher_pid}
    return [r for r in trace if r["pid"] in parents]


def milestones(run: Run, trace: List[Dict[str, Any]], launcher_pid: int) -> Dict[str, Optional[float]]:
    """Seconds from the command to each milestone on the critical path (the later worker for worker steps)."""
    main = _by_pid(trace).get(launcher_pid, [])
    workers = list(worker_records(trace, launcher_pid).values())
    server = forkserver_records(trace, launcher_pid)

    def latest(what: str) -> Optional[float]:
        times = [_first(w, what) for w in workers]
        return max(t for t in times if t is not None) if times and all(t is not None for t in times) else None

    t0 = run.started
    m = {
        "interpreter_up": _first(main, "process"),
        "hydra_imported": _first(main, "import:hydra"),
        "launch_start": _first(main, "launcher_run_job:start"),
        "adapter_start": _first(main, "torchrun_adapter_run:start"),
        "launcher_torch_imported": _first(main, "import:torch"),
        "forkserver_ready": _first(server, "import:steadfast.run"),  # its last preload
        "workers_started": min((_started(w) for w in workers), default=None) or _first(main, "agent_start_workers:end"),
        "workers_torch_imported": latest("import:torch"),  # spawned workers only: forked ones have it
        "workers_init_pg_start": latest("init_process_group:start"),
        "workers_init_pg_end": latest("init_process_group:end"),
        "workers_ddp_end": latest("ddp_init:end"),
        "workers_resume_end": latest("trainer_resume:end"),
        "first_step": run.first_step_time(),
    }
    return {k: (v - t0 if v is not None else None) for k, v in m.items()}


# (label, from milestone, to milestone); a segment whose milestones a side lacks is 0 for it.
SEGMENTS = [
    ("python start-up (exec, site)", None, "interpreter_up"),
    ("Hydra + app imports", "interpreter_up", "hydra_imported"),
    ("Hydra compose x N, plugin discovery, pre-flight", "hydra_imported", "launch_start"),
    ("run lock, config freeze, payload pickle", "launch_start", "adapter_start"),
    ("torch import in the launcher / torchrun", "adapter_start", "launcher_torch_imported"),
    ("agent rendezvous, first worker created (forkserver: its imports done)", "launcher_torch_imported", "workers_started"),
    ("workers: spawn + imports (Python, Hydra, torch; none when forked)", "workers_started", "workers_torch_imported"),
    ("workers: Hydra state, trainer import, wait for peers", "workers_torch_imported", "workers_init_pg_start"),
    ("init_process_group", "workers_init_pg_start", "workers_init_pg_end"),
    ("data + model + DDP init (DDP imports torch._dynamo)", "workers_init_pg_end", "workers_ddp_end"),
    ("checkpoint discovery (resume=auto)", "workers_ddp_end", "workers_resume_end"),
    ("to the end of the first step", "workers_resume_end", "first_step"),
]


def segments(ms: Dict[str, Optional[float]]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    prev_known = 0.0
    for label, a, b in SEGMENTS:
        end = ms.get(b)
        if end is None:
            out[label] = 0.0
            continue
        start = ms.get(a) if a else 0.0
        start = prev_known if start is None else start
        out[label] = max(0.0, end - start)
        prev_known = end
    return out


def details(trace: List[Dict[str, Any]], launcher_pid: int) -> Dict[str, Any]:
    main = [r for r in trace if r["pid"] == launcher_pid]
    workers = [r for recs in worker_records(trace, launcher_pid).values() for r in recs]
    server = forkserver_records(trace, launcher_pid)
    compose, n = _total(main, "hydra_compose:end")
    scan, _ = _total(main, "hydra_plugin_scan:end")
    worker_imports = {
        name: max([r["t"] - r["start"] for r in workers if r["what"] == f"import:{name}"] or [0.0]) for name in ("hydra", "torch")
    }
    created = [r["created"] for r in server if r["what"] == "process"]
    ready = _first(server, "import:steadfast.run")
    return {
        "hydra_compose_calls": n,
        "hydra_compose_s": compose,
        "plugin_scan_s": scan,
        "preflight_s": _total(main, "launcher_preflight:end")[0],
        "launcher_torch_import_s": max([r["t"] - r["start"] for r in main if r["what"] == "import:torch"] or [0.0]),
        "worker_hydra_import_s (slowest)": worker_imports["hydra"],
        "worker_torch_import_s (slowest)": worker_imports["torch"],
        "ddp_init_s (slowest)": max([r["t"] - r["start"] for r in workers if r["what"] == "ddp_init:end"] or [0.0]),
        "checkpoint_discovery_s (slowest)": max(
            [r["t"] - r["start"] for r in workers if r["what"] == "trainer_resume:end"] or [0.0]
        ),
        "forkserver_preload_s": (ready - created[0]) if ready is not None and created else None,
        "payload_bytes": next((r["bytes"] for r in main if r["what"] == "payload"), None),
        "workers_created_apart_s": _spawn_gap(trace, launcher_pid),
    }


def _spawn_gap(trace: List[Dict[str, Any]], launcher_pid: int) -> Optional[float]:
    """Seconds between the creation of the first and the last worker."""
    started = [_started(recs) for recs in worker_records(trace, launcher_pid).values()]
    return max(started) - min(started) if len(started) > 1 else None


def traced(work: Workdir, kind: str, job: Job, timeout: float, extra_overrides: Sequence[str] = ()) -> Tuple[Run, Dict[str, Any]]:
    path = work.path / f"trace-{work.count + 1}.jsonl"
    if kind == "baseline":
        run = run_baseline(work, "traced-baseline", job, timeout, trace=path)
    else:
        run = run_ours(work, "traced-ours", ours_overrides(job) + list(extra_overrides), timeout, trace=path)
    check(run, f"traced {kind}")
    trace = read_jsonl(path)
    launcher = run.pid
    if not any(r["pid"] == launcher for r in trace):
        raise RuntimeError(f"traced {kind}: the launcher process left no trace (is bench/trace on PYTHONPATH?)")
    ms = milestones(run, trace, launcher)
    return run, {"milestones_s": ms, "segments_s": segments(ms), "details": details(trace, launcher)}


# Traced variants besides the default: the other start methods.
VARIANTS = {k: v for k, v in START_METHODS.items() if k != "ours"}


def breakdown(
    work: Workdir, job: Job, rounds: int, timeout: float, variants: bool = True, baseline: bool = True
) -> Dict[str, Any]:
    samples: Dict[str, List[Dict[str, Any]]] = {"baseline": [], "ours": []} if baseline else {"ours": []}
    makers = [("ours", lambda: traced(work, "ours", job, timeout))]
    if baseline:
        makers.insert(0, ("baseline", lambda: traced(work, "baseline", job, timeout)))
    for name, overrides in VARIANTS.items() if variants else ():
        samples[name] = []
        makers.append((name, functools.partial(traced, work, "ours", job, timeout, overrides)))

    def keep(name: str, r: int, item: Any) -> None:
        run, info = item
        samples[name].append(info)
        log(f"  traced round {r + 1} {name:<15} ttfs {fmt(run.ttfs(), 2)} s")

    alternate(rounds, makers, keep)  # type: ignore[arg-type]
    out: Dict[str, Any] = {}
    for name, infos in samples.items():
        labels = [s[0] for s in SEGMENTS]
        out[name] = {
            "segments_s": {lab: median([i["segments_s"][lab] for i in infos]) for lab in labels},
            "milestones_s": {k: median([i["milestones_s"][k] for i in infos]) for k in infos[0]["milestones_s"]},
            "details": {k: median([i["details"][k] for i in infos]) for k in infos[0]["details"]},
            "ttfs_s": median([i["milestones_s"]["first_step"] for i in infos]),
        }
    if baseline:
        out["extra_s"] = {lab: out["ours"]["segments_s"][lab] - out["baseline"]["segments_s"][lab] for lab, _, _ in SEGMENTS}
    return out


def measure(job: Job, rounds: int, traced_rounds: int, variants: bool = True, timeout: float = 180) -> Dict[str, Any]:
    """`rounds` untraced rounds give the headline; with rounds=0 (smoke test) the traced runs do."""
    if rounds == 0:  # the smoke test: one traced run of ours
        with Workdir() as work:
            b = breakdown(work, job, traced_rounds, timeout, variants=False, baseline=False)
        return {
            "job": job.describe(),
            "rounds": 0,
            "traced_only": True,
            "ttfs_s": {"ours": spread([b["ours"]["ttfs_s"]])},
            "ratios": {},
            "breakdown": b,
        }
    with Workdir() as work:
        makers = [("baseline", lambda: run_baseline(work, "baseline", job, timeout))]
        for name, overrides in START_METHODS.items() if variants else [("ours", [])]:
            makers.append((name, functools.partial(run_ours, work, name, ours_overrides(job) + overrides, timeout)))

        def show(name: str, r: int, run: Run) -> None:
            check(run, f"startup {name}")
            log(f"  round {r + 1} {name:<12} ttfs {fmt(run.ttfs(), 2)} s  wall {run.wall:.1f} s")

        runs = alternate(rounds, makers, show)
        ttfs = {k: [r.ttfs() for r in v] for k, v in runs.items()}
        base = median(ttfs["baseline"])
        out: Dict[str, Any] = {
            "job": job.describe(),
            "rounds": rounds,
            "ttfs_s": {k: spread(v) for k, v in ttfs.items()},
            "wall_s": {k: spread([r.wall for r in v]) for k, v in runs.items()},
            "foreign_load": {k: foreign(v) for k, v in runs.items()},
            "baseline_aborted_at_exit": aborted_at_exit(runs["baseline"]),
            "ratios": {f"{k}/baseline ttfs": ratio(median(v), base) for k, v in ttfs.items() if k != "baseline"},
        }
        out["ratios"]["ours/baseline ttfs (median of paired rounds)"] = median(
            [ratio(o, b) for o, b in zip(ttfs["ours"], ttfs["baseline"])]
        )
        if traced_rounds:
            out["breakdown"] = breakdown(work, job, traced_rounds, timeout, variants)
    return out


def report(res: Dict[str, Any]) -> None:
    print(f"\nTime to first step ({res['rounds']} rounds" + (", traced runs only" if res.get("traced_only") else "") + ")")
    for k, v in res["ttfs_s"].items():
        print(f"  {k:<14} median {fmt(v['median'], 2)} s  (min {fmt(v['min'], 2)}, max {fmt(v['max'], 2)})")
    for k, v in res["ratios"].items():
        print(f"  {k:<50} {fmt(v)}")
    b = res.get("breakdown")
    if b and "baseline" in b:
        var = [k for k in VARIANTS if k in b]
        print(
            f"\n  {'segment (median of traced runs, s)':<55}{'baseline':>9}{'ours':>9}{'extra':>9}"
            + "".join(f"{k[5:]:>11}" for k in var)
        )
        for lab, _, _ in SEGMENTS:
            print(
                f"  {lab:<55}{b['baseline']['segments_s'][lab]:>9.3f}{b['ours']['segments_s'][lab]:>9.3f}"
                f"{b['extra_s'][lab]:>9.3f}" + "".join(f"{b[k]['segments_s'][lab]:>11.3f}" for k in var)
            )
        print(
            f"  {'time to first step (traced)':<55}{b['baseline']['ttfs_s']:>9.3f}{b['ours']['ttfs_s']:>9.3f}"
            f"{b['ours']['ttfs_s'] - b['baseline']['ttfs_s']:>9.3f}" + "".join(f"{b[k]['ttfs_s']:>11.3f}" for k in var)
        )
        for k, v in b["ours"]["details"].items():
            print(f"    ours {k}: {fmt(v)}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--traced", type=int, default=1, help="rounds of traced runs for the breakdown (0: none)")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--quick", action="store_true", help="2 rounds, 1 traced round")
    p.add_argument("--tiny", action="store_true", help="one traced run of ours only (smoke test)")
    p.add_argument("--json", type=Path, default=RESULTS / "startup.json")
    args = p.parse_args(argv)
    rounds, traced_rounds, variants = args.rounds, args.traced, not args.no_variants
    if args.quick:
        rounds, traced_rounds = 2, 1
    if args.tiny:
        rounds, traced_rounds, variants = 0, 1, False
    log(f"time to first step: {rounds} rounds, {traced_rounds} traced")
    res = measure(TINY, rounds, traced_rounds, variants)
    res["target"] = {"ours/baseline ttfs": TARGET}
    out = {"benchmark": "startup", "command": command_line("bench.startup", argv), "machine": machine(), **res}
    report(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
