"""Recovery of a compiled model: a restart with the run's compile cache (warm) against one that
compiles again from nothing (cold).

    .venv/bin/python bench/probes/compile_recovery.py [--rounds 3] [--nproc 2] [--compiler inductor] [--json PATH]

The app is tests/apps/compiled (an MLP 20-32-4 under `torch.compile` with Inductor, then DDP through
`run.setup`), on `--nproc` torchrun workers, rank 0 killed (SIGKILL) after step 3 and restarted once.
Each round runs it twice in a fresh run folder (so a fresh compile cache), in a rotated order:

  warm  as shipped: the restart finds what the first attempt compiled in the run's cache
  cold  TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: every attempt compiles from nothing (what a restart
        costs when its cache is gone: a per-job /tmp, another machine)

Figures, from the run's events.jsonl: `recovery` is the failure (attempt_failed) to the restart's
first step (first_step of restart 1); `start` is an attempt's attempt_started to its first step
(attempt 0 of warm is a cold compile too). Medians over the rounds. `--compiler`: torch.compile's backend
(its smoke test: eager, Dynamo's capture without Inductor's code generation).
A development probe: its figures are quoted in BENCHMARKS.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import env  # noqa: E402
from steadfast.contract import compile_cache  # noqa: E402

APP = ROOT / "tests" / "apps" / "compiled"


def one(cwd: Path, name: str, nproc: int, cold: bool, compiler: str) -> Dict[str, float]:
    extra = {"OMP_NUM_THREADS": "1", **({"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if cold else {})}
    overrides = [
        "fault=kill_rank",
        "fault.at_step=3",
        f"backend.nproc_per_node={nproc}",
        f"backend_compiler={compiler}",
        f"run.name={name}",
    ]
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=cwd, env=env(extra=extra), capture_output=True, text=True, timeout=900
    )
    folder = cwd / "outputs" / name
    shutil.rmtree(compile_cache.folder(folder), ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines() if line.strip()]

    def at(kind: str, restart: int) -> float:
        return next(e["time"] for e in events if e["event"] == kind and e.get("restart") == restart)

    return {
        "start_0": at("first_step", 0) - at("attempt_started", 0),
        "start_1": at("first_step", 1) - at("attempt_started", 1),
        "recovery": at("first_step", 1) - at("attempt_failed", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--compiler", default="inductor", help="torch.compile's backend")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    found: Dict[str, List[Dict[str, float]]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp) / "app"
        shutil.copytree(APP, cwd)
        for r in range(args.rounds):
            for kind in ("warm", "cold") if r % 2 == 0 else ("cold", "warm"):
                found[kind].append(one(cwd, f"{kind}{r}", args.nproc, kind == "cold", args.compiler))
                print(kind, r, {k: round(v, 2) for k, v in found[kind][-1].items()}, flush=True)
    medians = {kind: {k: round(statistics.median(x[k] for x in rows), 2) for k in rows[0]} for kind, rows in found.items()}
    print(json.dumps({"nproc": args.nproc, "rounds": args.rounds, "median_s": medians}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rounds": found, "median_s": medians}, indent=1))


if __name__ == "__main__":
    main()
