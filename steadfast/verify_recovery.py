"""Resume equivalence, checked: `python -m pipeline.verify_recovery [overrides]`.

Runs the job described by the overrides twice: once without faults (the reference), and once
under the fault schedule given by the `fault` overrides (default: `fault=kill_rank`), running the
same command again whenever a launch stops on request (exit code 75, e.g. `fault=sigterm`),
as a scheduler would. Then it compares the final `model_sha256` of the two runs: with recovery
that loses nothing, they are equal bit for bit. Exit code 0 when they match, 1 when they differ,
2 when a run failed.

  python -m pipeline.verify_recovery fault=kill_rank fault.at_step=40 trainer.max_epochs=4
  python -m pipeline.verify_recovery fault=sigterm fault.at_step=30 checkpoint=every_n_steps
  python -m pipeline.verify_recovery fault=hang_rank restart.hang_timeout_s=10 backend=horovod

The two runs live in outputs/verify_recovery/<name>/{reference,faulted}, replaced on every check
(the name comes from the overrides other than the fault's; `--name` sets it). Read what
happened with `python -m pipeline.report outputs/verify_recovery/<name>/faulted`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .contract import events, summary
from .contract.events import Event
from .contract.exits import EXIT_PREEMPTED


def split_overrides(overrides: Sequence[str]) -> tuple[List[str], List[str]]:
    """(the job's overrides, the fault schedule's overrides)."""
    fault: List[str] = []
    job: List[str] = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        (fault if key == "fault" or key.startswith("fault.") else job).append(o)
    return job, fault


def _events(folder: Path) -> List[Dict[str, Any]]:
    return events.read(folder)


def _summary(folder: Path) -> Dict[str, Any]:
    return summary.read(folder)


def run_job(
    app: str, overrides: List[str], root: Path, name: str, verbose: bool, max_launches: int
) -> tuple[int, int, float, str]:
    """Run until the job completes or fails; a stop on request (75) is run again. (exit code, launches, seconds, output)."""
    cmd = [sys.executable, "-m", app, *overrides, f"run.name={name}", f"hydra.sweep.dir='{root}'"]
    started, launches, out = time.monotonic(), 0, ""
    while launches < max_launches:
        launches += 1
        proc = subprocess.run(cmd, stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = proc.stdout or ""
        if proc.returncode != EXIT_PREEMPTED:
            return proc.returncode, launches, time.monotonic() - started, out
        print(f"  {name}: launch {launches} stopped on request (exit code 75); running the same command again")
    return EXIT_PREEMPTED, launches, time.monotonic() - started, out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.verify_recovery",
        description=__doc__.split("\n\n")[0],
        epilog="Every other argument is a Hydra override of the training job (as for pipeline.train).",
    )
    parser.add_argument(
        "--app", default="pipeline.train", help="the training app's module, run as `python -m APP` (default: pipeline.train)"
    )
    parser.add_argument("--name", help="folder name under outputs/verify_recovery (default: from the overrides)")
    parser.add_argument("--root", type=Path, default=Path("outputs") / "verify_recovery")
    parser.add_argument(
        "--max-launches", type=int, default=5, help="launches of the faulted run at most (each stop on request is run again)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the runs' own output")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s): {' '.join(bad)}")
    job, fault = split_overrides(overrides)
    job = [o for o in job if not o.lstrip("+~").startswith(("run.name=", "hydra.sweep.dir="))]
    if not fault:
        fault = ["fault=kill_rank"]
    import hydra_plugins.steadfast_launcher.backends  # noqa: F401  (the backends' world-size keys name runs)

    from .contract.naming import run_name

    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", args.name or run_name(job))  # a folder name Hydra overrides can carry
    root = args.root / name
    for sub in ("reference", "faulted"):
        shutil.rmtree(root / sub, ignore_errors=True)  # this tool's own folders: every check starts fresh
    root.mkdir(parents=True, exist_ok=True)
    print(f"verify_recovery: job [{' '.join(job) or 'defaults'}], fault schedule [{' '.join(fault)}]")
    print(f"  runs in {root}/")
    results: Dict[str, Dict[str, Any]] = {}
    for sub, extra in (("reference", ["fault=none"]), ("faulted", fault)):
        code, launches, seconds, out = run_job(args.app, [*job, *extra], root, sub, args.verbose, args.max_launches)
        summary = _summary(root / sub)
        results[sub] = {"code": code, "launches": launches, "summary": summary}
        print(
            f"  {sub}: exit code {code} after {launches} launch(es), {seconds:.1f} s, status {summary.get('status', '?')}, "
            f"restarts {summary.get('restarts', '?')}"
        )
        if code != 0 or summary.get("status") != "completed":
            print(out[-6000:], file=sys.stderr)
            print(f"RESULT: the {sub} run did not complete (exit code {code}); see {root / sub}", file=sys.stderr)
            return 2
    events = _events(root / "faulted")
    fired = [e for e in events if e.get("event") == Event.FAULT_FIRED]
    resumed = [e.get("step") for e in events if e.get("event") == Event.RESUMED]
    hangs = [e for e in events if e.get("event") == Event.HANG_DETECTED]
    for e in fired:
        print(f"  fault fired: {e.get('fault')} on rank {e.get('rank')} at step {e.get('step')} (restart {e.get('restart')})")
    for e in hangs:
        print(f"  hang detected: rank {e.get('rank')} at step {e.get('step')} after {e.get('seconds_without_progress')} s")
    if resumed:
        print(f"  faulted run resumed from step(s) {', '.join(str(s) for s in resumed)}")
    if not fired:
        print("  warning: no fault fired (is fault.at_step within the run? fault.rank within the workers?)")
    ref, got = results["reference"]["summary"].get("model_sha256"), results["faulted"]["summary"].get("model_sha256")
    print(f"  reference model_sha256 {ref}")
    print(f"  faulted   model_sha256 {got}")
    if ref and ref == got:
        print("RESULT: MATCH: the run recovered to exactly the same weights as the uninterrupted run")
        return 0
    print("RESULT: MISMATCH: the recovered run ended with different weights", file=sys.stderr)
    print(f"  compare: python -m pipeline.report {root / 'faulted'}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
