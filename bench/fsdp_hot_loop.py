"""The FSDP2 hot loop alone, with enough alternated rounds to tell the code from the noise.

    python -m bench.fsdp_hot_loop [--rounds 8] [--quick | --tiny] [--json PATH]

bench.sharded's fourth measurement (`python -m pipeline.train parallel=fsdp trainer.optimizer=adamw`
against bench/baseline_fsdp.py under torchrun, 2 workers, the hot-loop job with half its data: 192
steps per worker) run on its own: `--rounds` rounds, ours and the baseline back to back in a rotated
order. The figure is the ratio of the medians; each round's own ratio (a pair of runs a few seconds
apart, so a change of the machine's load hits both) is kept with its median and spread: a gap that
stays in every round is the code, one that changes sign is the load. Where a gap goes:
bench/probes/fsdp_hot_variants.py (ours with snapshots off, ...) and bench/probes/fsdp_step_cost.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import HOT, RESULTS, command_line, log, machine, write_json
from .sharded import hot_loop, hot_report

TARGET = ("hot loop steps/s, ours / hand-written FSDP2", (">=", 0.97))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="4 rounds")
    p.add_argument("--tiny", action="store_true", help="1 round of a tiny job (smoke test)")
    p.add_argument("--json", type=Path, default=RESULTS / "fsdp_hot_loop.json")
    args = p.parse_args(argv)
    job, rounds = dataclasses.replace(HOT, num_samples=HOT.num_samples // 2), args.rounds
    if args.quick:
        rounds = 4
    if args.tiny:
        job, rounds = dataclasses.replace(HOT, num_samples=2048, num_features=16, hidden=(64, 64), log_every=2), 1
    log(f"FSDP2 hot loop: {rounds} alternated round(s), {job.steps_per_epoch()} steps per worker")
    hot: Dict[str, Any] = hot_loop(rounds, job)
    out = {
        "benchmark": "fsdp_hot_loop",
        "command": command_line("bench.fsdp_hot_loop", argv),
        "machine": machine(),
        "targets": dict([TARGET]),
        "hot_loop": hot,
    }
    hot_report(hot)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
