"""bench.sharded's FSDP2 hot loop with more rounds and variants of ours: the hand-written baseline
(bench/baseline_fsdp.py) and `python -m pipeline.train parallel=fsdp trainer.optimizer=adamw` with
each variant's extra overrides, alternated in a rotated order (bench.common.alternate).

    .venv/bin/python bench/probes/fsdp_hot_variants.py NAME "OVERRIDES" [NAME "OVERRIDES" ...]   (ROUNDS=N, default 3)

e.g. `ours "" snap_off "snapshot=off"`. Prints, per run, steps/s (the median logged 10-step interval
after 30 warm-up steps), CPU ms per step of every process, other tenants' share of the machine and
the intervals snapshot.every_n_steps=auto chose. A development probe: its figures are quoted in
bench/NOTES.md, not in the tables.
"""

import functools
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import HOT, ROOT, Workdir, alternate, cpu_per_step, run_baseline, run_ours, steady_rate  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "3"))
base = [*HOT.overrides(), "parallel=fsdp", "trainer.optimizer=adamw", "checkpoint.every_n_epochs=1000"]
variants = {sys.argv[i]: base + sys.argv[i + 1].split() for i in range(1, len(sys.argv) - 1, 2)}

with Workdir() as work:
    script = ROOT / "bench" / "baseline_fsdp.py"
    makers = [("baseline", lambda: run_baseline(work, "b", HOT, 600, sample_cpu=True, loader="slices", script=script))]
    for name, overrides in variants.items():
        makers.append((name, functools.partial(run_ours, work, "o", overrides, 600, sample_cpu=True)))

    def on_run(name: str, r: int, run: Any) -> None:
        cpu = (cpu_per_step(run, 30) or {}).get("total_cpu_s_per_step") or 0
        every = [e.get("every_n_steps") for e in run.events if e.get("event") == "snapshot_interval"]
        print(
            f"{name} round {r}: {'ok' if run.ok else 'FAILED'} steps/s {steady_rate(run, 30) or 0:.1f}"
            f" CPU ms/step {cpu * 1e3:.2f} foreign {run.extra['load']['foreign_share']:.2f} auto intervals {every}",
            flush=True,
        )

    alternate(ROUNDS, makers, on_run)
