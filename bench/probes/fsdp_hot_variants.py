"""bench.sharded's FSDP2 hot loop with more rounds and variants of ours: the hand-written baseline
(bench/baseline_fsdp.py) and `python -m pipeline.train parallel=fsdp trainer.optimizer=adamw` with
each variant's extra overrides, alternated in a rotated order (bench.common.alternate).

    .venv/bin/python bench/probes/fsdp_hot_variants.py [--tiny] NAME "OVERRIDES" [NAME "OVERRIDES" ...]   (ROUNDS=N, default 3)

e.g. `ours "" snap_off "snapshot=off"`. Prints, per run, steps/s (the median logged 10-step interval
after 30 warm-up steps), CPU ms per step of every process (and of the workers and the launcher apart), other tenants' share of the machine and
the intervals snapshot.every_n_steps=auto chose. `--tiny`: bench.common's tiny job and 5 warm-up
steps (its smoke test). A development probe: its figures are quoted in bench/NOTES.md, not in the tables.
"""

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import HOT, ROOT, TINY, Workdir, alternate, cpu_per_step, run_baseline, run_ours, steady_rate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", metavar="NAME OVERRIDES", help="pairs: a variant's name, its overrides")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if len(args.variants) % 2:
        p.error('variants come in pairs: NAME "OVERRIDES"')
    rounds = int(os.environ.get("ROUNDS", "3"))
    job, warmup = (TINY, 5) if args.tiny else (HOT, 30)
    base = [*job.overrides(), "parallel=fsdp", "trainer.optimizer=adamw", "checkpoint.every_n_epochs=1000"]
    pairs = args.variants
    variants = {pairs[i]: base + pairs[i + 1].split() for i in range(0, len(pairs), 2)}

    with Workdir() as work:
        script = ROOT / "bench" / "baseline_fsdp.py"
        makers = [("baseline", lambda: run_baseline(work, "b", job, 600, sample_cpu=True, loader="slices", script=script))]
        for name, overrides in variants.items():
            makers.append((name, functools.partial(run_ours, work, "o", overrides, 600, sample_cpu=True)))

        def on_run(name: str, r: int, run: Any) -> None:
            per_step = cpu_per_step(run, warmup) or {}
            cpu, workers = per_step.get("total_cpu_s_per_step") or 0, per_step.get("workers_cpu_s_per_step") or 0
            every = [e.get("every_n_steps") for e in run.events if e.get("event") == "snapshot_interval"]
            print(
                f"{name} round {r}: {'ok' if run.ok else 'FAILED'} steps/s {steady_rate(run, warmup) or 0:.1f}"
                f" CPU ms/step {cpu * 1e3:.2f} (workers {workers * 1e3:.2f}, launcher {(cpu - workers) * 1e3:.2f}) foreign {run.extra['load']['foreign_share']:.2f} auto intervals {every}",
                flush=True,
            )

        alternate(rounds, makers, on_run)


if __name__ == "__main__":
    main()
