"""Where an asynchronous save's blocking part goes: section 5's states B and C, phase by phase.

    .venv/bin/python bench/probes/async_save_parts.py [B|C] [--saves 8]

A manager with `async_save=True` saves the state `--saves` times after a first, untimed save (which
allocates what later ones reuse), waiting for each save's background write before the next. Each
save's time inside save() is split at three points: the codec's plan (before it: the objects' state
dicts and the choice of codec), the snapshot (which tensors are copied now, the copies) and the
hand-over to the background thread. Printed per save, in milliseconds from the call.

A development probe: its figures are quoted in a commit or report, not in the tables.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "launchers")]

from bench.checkpoint_io import manager, model_case, params_case  # noqa: E402
from steadfast.checkpoint import replicated  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", nargs="?", default="C", choices=["B", "C"])
    p.add_argument("--saves", type=int, default=8)
    args = p.parse_args()
    case = params_case("C", 128, 4096) if args.case == "C" else model_case([64, 64])
    root = Path(tempfile.mkdtemp(prefix="async-save-parts-"))
    marks: List[Tuple[str, float]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            marks.append((f"{name}<", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((f"{name}>", time.perf_counter()))

        return inner

    try:
        m = manager(root / "checkpoints", async_save=True, keep_last=2)
        m.save(1, case.objects, case.per_rank, {"epoch": 0})
        m.wait()
        replicated.ReplicatedCodec.plan = timed("plan", replicated.ReplicatedCodec.plan)  # type: ignore[method-assign]
        m._stage = timed("staging", m._stage)  # type: ignore[method-assign]
        m._pool.submit = timed("submit", m._pool.submit)  # type: ignore[method-assign]
        totals = []
        for step in range(2, 2 + args.saves):
            marks.clear()
            began = time.perf_counter()
            m.save(step, case.objects, case.per_rank, {"epoch": 0})
            totals.append(time.perf_counter() - began)
            m.wait()
            print(f"save {step}: {1e3 * totals[-1]:7.3f} ms  " + " ".join(f"{n} {1e3 * (t - began):.3f}" for n, t in marks))
        print(f"{case.name}: blocked median {1e3 * statistics.median(totals):.3f} ms over {len(totals)} saves")
        m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
