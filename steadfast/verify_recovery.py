"""`steadfast-verify`: does this app resume exactly? Any app: `steadfast-verify --app train.py [overrides]`.

Runs the app twice with the same overrides: once uninterrupted (the reference), once killed and
resumed. By default the second run's workers are killed as a failing machine kills them: SIGKILL
to a worker at a fifth of the reference's steps, to another at two fifths (the launcher restarts
the workers each time), SIGTERM to the launcher at three fifths (a preemption: every rank saves and
the launch exits with 75), then the same command again, as a scheduler would, until it completes.
`fault` overrides replace that schedule with the fault group's (`fault=sigterm fault.at_step=30`).

Then it compares: the final `model_sha256` of the two runs, and their checkpoints of the same
steps object by object, key by key (every file verified, nothing unpickled). The result is MATCH
only when the weights and every tracked state are equal; otherwise it names the first step whose
checkpoints differ, the objects that differ there with their first differing key, and the state
the library cannot see to suspect (a batch fetched ahead, the global RNG, a counter of the loop's).
Exit code 0: match; 1: they differ; 2: a run failed.

  steadfast-verify --app examples.nanogpt.train max_iters=200      # a module, as `python -m` runs it
  steadfast-verify --app train.py                                  # a script (the guide's app)
  steadfast-verify fault=sigterm fault.at_step=30 checkpoint=every_n_steps   # the built-in trainer, one fault

The runs live in outputs/verify_recovery/<name>/{reference,faulted}, replaced by every check (the
name comes from the overrides other than the fault's; `--name` sets it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .contract import events, summary
from .contract.events import Event
from .contract.exits import EXIT_PREEMPTED
from .contract.heartbeat import read_heartbeats

WORKING = ("train", "save", "validate")  # heartbeat phases of a worker that is training
Kill = Tuple[str, int, int]  # ("kill", rank, step): SIGKILL that worker; ("term", -1, step): SIGTERM to the launcher


def split_overrides(overrides: Sequence[str]) -> tuple[List[str], List[str]]:
    """(the job's overrides, the fault schedule's overrides)."""
    fault: List[str] = []
    job: List[str] = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        (fault if key == "fault" or key.startswith("fault.") else job).append(o)
    return job, fault


def app_command(app: str) -> List[str]:
    """How to start the app: a script (`train.py`, a path) with python, anything else as `python -m APP`."""
    return [sys.executable, app] if app.endswith(".py") or os.sep in app else [sys.executable, "-m", app]


def kill_plan(total_steps: int, world_size: int) -> List[Kill]:
    """SIGKILL rank 1 (or 0) at a fifth of the steps, rank 0 at two fifths, SIGTERM at three fifths
    (the ranks agree on a stop some steps after the signal: the rest leaves room for it)."""
    at = [max(1, total_steps * k // 5) for k in (1, 2, 3)]
    return [("kill", 1 % world_size, at[0]), ("kill", 0, at[1]), ("term", -1, at[2])]


def _signal_when_reached(proc: "subprocess.Popen[str]", folder: Path, kill: Kill, attempt: int, timeout: float) -> Optional[int]:
    """Wait for the worker's heartbeat (in `attempt` of this launch) to pass the step, then signal;
    the step its heartbeat showed, or None when the launch ended first."""
    kind, rank, step = kill
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        beats = read_heartbeats(folder)
        beat = beats.get(rank if rank >= 0 else min(beats, default=0))
        if beat and beat.get("restart") == attempt and beat.get("phase") in WORKING and int(beat.get("step", -1)) >= step:
            os.kill(int(beat["pid"]) if kind == "kill" else proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            return int(beat["step"])
        time.sleep(0.01)
    return None


def run_job(
    cmd: List[str], overrides: List[str], root: Path, name: str, verbose: bool, max_launches: int, plan: Sequence[Kill] = ()
) -> tuple[int, int, float, str, List[str]]:
    """Run until the job completes or fails; a stop on request (75) is run again. `plan`: signals sent
    in the first launch as its heartbeats reach their steps. (exit code, launches, seconds, output, what was sent)."""
    cmd = [*cmd, *overrides, f"run.name={name}", f"hydra.sweep.dir='{root}'"]
    started, launches, out, sent = time.monotonic(), 0, "", []
    while launches < max_launches:
        launches += 1
        proc = subprocess.Popen(cmd, stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for attempt, kill in enumerate(plan if launches == 1 else ()):
                reached = _signal_when_reached(proc, root / name, kill, attempt, timeout=600)
                what = "SIGKILL to rank %d" % kill[1] if kill[0] == "kill" else "SIGTERM to the launcher"
                sent.append(
                    f"{what} at step {reached}" if reached is not None else f"{what}: the run ended before step {kill[2]}"
                )
                if reached is None:
                    break
            out = proc.communicate()[0] or ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if proc.returncode != EXIT_PREEMPTED:
            return proc.returncode, launches, time.monotonic() - started, out, sent
        print(f"  {name}: launch {launches} stopped on request (exit code 75); running the same command again")
    return EXIT_PREEMPTED, launches, time.monotonic() - started, out, sent


def _what_happened(folder: Path) -> None:
    records = events.read(folder)
    for e in records:
        if e.get("event") == Event.FAULT_FIRED:
            print(f"  fault fired: {e.get('fault')} on rank {e.get('rank')} at step {e.get('step')} (restart {e.get('restart')})")
        elif e.get("event") == Event.PREEMPTED:
            print(f"  stopped on request at step {e.get('step')} ({e.get('signal')}), that step committed")
        elif e.get("event") == Event.HANG_DETECTED:
            print(f"  hang detected: rank {e.get('rank')} at step {e.get('step')} after {e.get('seconds_without_progress')} s")
    resumed = [e.get("step") for e in records if e.get("event") == Event.RESUMED]
    if resumed:
        print(f"  faulted run resumed from step(s) {', '.join(str(s) for s in resumed)}")


def _checkpoints(folder: Path) -> Path:
    """Where a run's checkpoints are: its frozen config's checkpoint.dir (read as the report reads it), or checkpoints/."""
    from .contract.files import CONFIG_FILE, MAX_JSON_BYTES, read_regular
    from .report.loader import checkpoint_dir

    data = read_regular(folder / CONFIG_FILE, MAX_JSON_BYTES)
    try:
        text = data.decode() if data is not None else None
    except UnicodeDecodeError:
        text = None
    return Path(checkpoint_dir(folder, text)[0])  # a folder: steadfast-verify compares checkpoints on disk


def compare_runs(reference: Path, faulted: Path) -> bool:
    """Print where the two runs' checkpoints first differ; True when every common one is the same."""
    from .checkpoint.compare import first_divergence, suspects

    diverged, compared, problems = first_divergence(_checkpoints(reference), _checkpoints(faulted))
    for problem in problems:
        print(f"  unreadable checkpoint: {problem}")
    if diverged is None:
        print(f"  checkpoints of the same step compared: {', '.join(map(str, compared)) or 'none'}: every tracked state equal")
        return True
    before = [s for s in compared if s < diverged.step]
    print(
        f"  first checkpoint that differs: step {diverged.step}"
        + (f" (the same at step(s) {', '.join(map(str, before))})" if before else "")
    )
    for d in diverged.diverged:
        more = f", {', '.join(repr(k) for k in d.keys[1:3])}" + (f" and {d.count - 3} more" if d.count > 3 else "")
        print(f"    {d.name}: differs at {d.first!r}{more if d.count > 1 else ''}")
    if diverged.same:
        print(f"    the same: {', '.join(diverged.same)}")
    for line in suspects(diverged.diverged):
        print(f"  suspect: {line}")
    return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="steadfast-verify",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Every other argument is a Hydra override of the app's job.",
    )
    parser.add_argument(
        "--app", default="pipeline.train", help="a module (python -m APP) or a script (APP.py); default: pipeline.train"
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
    import hydra_plugins.steadfast_launcher.backends  # noqa: F401  (the backends' world-size keys name runs)

    from .contract.naming import run_name

    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", args.name or run_name(job))  # a folder name Hydra overrides can carry
    root = args.root / name
    for sub in ("reference", "faulted"):
        shutil.rmtree(root / sub, ignore_errors=True)  # this tool's own folders: every check starts fresh
    root.mkdir(parents=True, exist_ok=True)
    cmd = app_command(args.app)
    schedule = " ".join(fault) or "SIGKILL a worker at 1/5 and 2/5 of the steps, SIGTERM at 3/5"
    print(f"verify_recovery: {args.app}, job [{' '.join(job) or 'defaults'}], fault schedule [{schedule}]")
    print(f"  runs in {root}/")
    results: Dict[str, Dict[str, Any]] = {}
    for sub in ("reference", "faulted"):
        plan: List[Kill] = []
        if sub == "faulted" and not fault:
            ref = results["reference"]["summary"]
            plan = kill_plan(int(ref.get("global_step") or 0), int(ref.get("world_size") or 1))
        extra = ["fault=none"] if sub == "reference" else fault
        code, launches, seconds, out, sent = run_job(cmd, [*job, *extra], root, sub, args.verbose, args.max_launches, plan)
        done = summary.read(root / sub)
        results[sub] = {"code": code, "summary": done}
        print(
            f"  {sub}: exit code {code} after {launches} launch(es), {seconds:.1f} s, status {done.get('status', '?')}, "
            f"restarts {done.get('restarts', '?')}"
        )
        for line in sent:
            print(f"  sent: {line}")
        if code != 0 or done.get("status") != "completed":
            print(out[-6000:], file=sys.stderr)
            print(f"RESULT: the {sub} run did not complete (exit code {code}); see {root / sub}", file=sys.stderr)
            return 2
    _what_happened(root / "faulted")
    if fault and not any(e.get("event") == Event.FAULT_FIRED for e in events.read(root / "faulted")):
        print("  warning: no fault fired (is fault.at_step within the run? fault.rank within the workers?)")
    ref, got = results["reference"]["summary"].get("model_sha256"), results["faulted"]["summary"].get("model_sha256")
    print(f"  reference model_sha256 {ref}")
    print(f"  faulted   model_sha256 {got}")
    same_state = compare_runs(root / "reference", root / "faulted")
    if ref and ref == got and same_state:
        print("RESULT: MATCH: the run recovered to exactly the same weights and state as the uninterrupted run")
        return 0
    what = "different weights" if ref != got else "the same weights but another state (its next steps would differ)"
    print(f"RESULT: MISMATCH: the recovered run ended with {what}", file=sys.stderr)
    print(f"  what happened: python -m steadfast.report {root / 'faulted'}", file=sys.stderr)
    return 1


def cli() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())


if __name__ == "__main__":
    cli()
