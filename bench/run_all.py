"""Every benchmark, one after the other, then BENCHMARKS.md: `make bench` (= python -m bench.run_all).

    python -m bench.run_all [--quick | --tiny] [--only hot_loop,startup,...] [--budget 840] [--no-report]

Each benchmark writes bench/results/<name>.json. The suite keeps to a time budget (default 20
minutes): before each benchmark it compares its expected duration (scaled by how much slower
than expected the earlier ones ran: the machine is shared) with what is left, and runs a
benchmark in its --quick form when the full one would not fit (the JSON and BENCHMARKS.md say
which form ran). A benchmark that fails is recorded and the others still run; the exit status
is then non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import RESULTS, ROOT, log, machine, write_json
from .cpu import cpu_counters, foreign_load

# name, module, [arguments]: expected seconds on the 2-core reference machine when nobody else
# uses it (full, quick).
SUITE: List[tuple] = [
    ("checkpoint_io", "bench.checkpoint_io", ["--mb", "128", "--repeats", "5"], (40, 8)),
    ("checkpoint_refactor", "bench.checkpoint_refactor", [], (120, 50)),
    ("checkpoint_s3", "bench.checkpoint_s3", [], (45, 25)),  # skipped, with the reason, without `weed`
    ("hot_loop", "bench.hot_loop", [], (130, 60)),
    ("step_cost", "bench.step_cost", [], (75, 35)),
    (
        "step_cost_1rank",
        "bench.step_cost",
        ["--nproc", "1", "--configs", "bare,run", "--rounds", "40", "--processes", "5"],
        (70, 15),
    ),
    ("stop_agreement", "bench.stop_agreement", [], (90, 45)),
    ("startup", "bench.startup", [], (100, 65)),
    ("recovery", "bench.recovery", [], (150, 110)),
    ("goodput", "bench.goodput", [], (240, 130)),
    ("horovod", "bench.horovod", [], (190, 50)),  # 6 rounds of ours, the hand-written script and torchrun
    ("scaling", "bench.scaling", [], (150, 46)),
    ("sharded", "bench.sharded", ["--hot-rounds", "0"], (230, 110)),  # its hot loop: fsdp_hot_loop
    ("fsdp_hot_loop", "bench.fsdp_hot_loop", [], (270, 140)),
    ("anomalies", "bench.anomalies", [], (90, 50)),
]
ALONE = ["--nproc", "1", "--configs", "bare,run"]  # step_cost_1rank: one rank alone, with and without steadfast.Run
QUICK_ARGS = {
    "checkpoint_io": ["--mb", "32", "--repeats", "2"],
    "step_cost_1rank": [*ALONE, "--rounds", "20"],
    "sharded": ["--quick", "--hot-rounds", "0"],
}
TINY_ARGS = {
    "step_cost_1rank": ["--tiny", *ALONE],
    "checkpoint_io": ["--mb", "4", "--tensors", "4", "--repeats", "1", "--no-drop-caches"],
    "sharded": ["--tiny", "--no-drop-caches"],
}


def git_state() -> Dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "pipeline", "launchers").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted_changes_in": dirty}


def carry_over(previous: Path, record: Dict[str, Any]) -> None:
    """A run of some benchmarks (--only) keeps the earlier run's entries of the others, each marked with
    the run it came from, so BENCHMARKS.md can say which figures are older."""
    try:
        before = json.loads(previous.read_text())
        entries = dict(before["benchmarks"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    origin = {
        "started": before.get("started"),
        "commit": (before.get("git") or {}).get("commit"),
        "command": before.get("command"),
    }
    for name, entry in entries.items():
        if name not in record["benchmarks"] and isinstance(entry, dict):
            record["benchmarks"][name] = {**entry, "earlier_run": entry.get("earlier_run") or origin}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every benchmark in its --quick form")
    p.add_argument("--tiny", action="store_true", help="every benchmark in its --tiny form (seconds; figures meaningless)")
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--budget", type=float, default=1200.0, help="seconds for the whole suite (quick forms when short)")
    p.add_argument("--no-report", action="store_true", help="do not rewrite BENCHMARKS.md")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="default: bench/results (with --tiny: a temporary folder, and no BENCHMARKS.md)",
    )
    args = p.parse_args(argv)
    if args.results is None:
        if args.tiny:  # smoke figures must not replace the real ones
            args.results, args.no_report = Path(tempfile.mkdtemp(prefix="steadfast-bench-tiny-")), True
        else:
            args.results = RESULTS
    only = {x for x in args.only.split(",") if x}
    suite = [s for s in SUITE if not only or s[0] in only]
    unknown = only - {s[0] for s in SUITE}
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}; known: {', '.join(s[0] for s in SUITE)}")

    started = time.time()
    record: Dict[str, Any] = {
        "command": "make bench"
        + (
            f" ARGS='{' '.join(argv if argv is not None else sys.argv[1:])}'"
            if (argv if argv is not None else sys.argv[1:])
            else ""
        ),
        "equivalent": " ".join(["python", "-m", "bench.run_all", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "git": git_state(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "budget_s": args.budget,
        "benchmarks": {},
    }
    failed = []
    # Other tenants' share of the machine right now: the first guess of how much slower than expected it runs.
    before = cpu_counters()
    time.sleep(2.0)
    record["foreign_share_at_start"] = foreign_load(before, 2.0)["foreign_share"]
    slow = 1.0 + record["foreign_share_at_start"]  # until a minute of expected time has run
    spent = expected = 0.0  # how the machine keeps up with the expected durations so far
    for i, (name, module, extra, (full_s, quick_s)) in enumerate(suite):
        left = args.budget - (time.time() - started)
        # enough evidence: a loaded machine makes everything take longer. Before a minute of expected
        # time, the benchmarks so far say little: checkpoint_io's 10 s are disk-bound (26 s on a slow
        # virtual disk once, which alone put the CPU-bound hot loop in its quick form at --budget 1500)
        if expected >= 60:
            slow = max(1.0, spent / expected)
        after = slow * sum(s[3][1] for s in suite[i + 1 :])  # what the rest needs at least (quick forms)
        form = "tiny" if args.tiny else "quick" if args.quick or left - after < slow * full_s else "full"
        if form == "quick" and not args.quick and left < slow * quick_s:
            log(f"=== {name}: skipped, {left:.0f} s of the budget left and its quick form needs ~{slow * quick_s:.0f} s here")
            record["benchmarks"][name] = {
                "form": "skipped",
                "reason": f"out of the time budget ({args.budget:.0f} s); run it alone: python -m {module}",
            }
            continue
        if args.tiny:
            margs = TINY_ARGS.get(name, ["--tiny"])
        elif form == "quick":
            margs = QUICK_ARGS.get(name, ["--quick"])
        else:
            margs = list(extra)
        out = args.results / f"{name}.json"
        margs = [*margs, "--json", str(out)]
        log(f"=== {name} ({form}): python -m {module} {' '.join(margs)}  [{left:.0f} s of the budget left]")
        t0 = time.time()
        entry: Dict[str, Any] = {"form": form, "args": margs}
        try:
            rc = importlib.import_module(module).main(margs)
            entry["exit_code"] = rc
            if rc:
                failed.append(name)
        except Exception as exc:  # keep going: the other figures are still worth having
            traceback.print_exc()
            entry["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            failed.append(name)
        entry["seconds"] = round(time.time() - t0, 1)
        if form != "tiny":
            spent += entry["seconds"]
            expected += full_s if form == "full" else quick_s
        record["benchmarks"][name] = entry
        log(f"=== {name}: {entry['seconds']} s")
    record["total_s"] = round(time.time() - started, 1)
    record["failed"] = failed
    if only:
        carry_over(args.results / "run_all.json", record)
    write_json(args.results / "run_all.json", record)
    if not args.no_report:
        from .report import write_report

        path = write_report(args.results)
        log(f"wrote {path}")
    log(f"suite: {record['total_s']:.0f} s" + (f", FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
