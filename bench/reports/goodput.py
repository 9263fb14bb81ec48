"""BENCHMARKS.md's rows and section 4, goodput under failure (bench.goodput); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..common import sources_text
from .cells import f, table, target


def rows(gp: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if gp:
        for r in gp["runs"]:
            goal = (
                0.92
                if r["period_s"] == 30 and r["cadence"].startswith("auto")
                else 0.90
                if r["period_s"] == 10 and not r["cadence"].startswith(("disk", "Young"))
                else None
            )
            memory = "" if r["cadence"].startswith("disk") else ", snapshots in memory"
            rows.append(
                target(
                    "4", f"goodput, a worker killed every {r['period_s']:g} s, {r['cadence']}{memory}", r["goodput"], ">=", goal
                )
            )
    return rows


def section(gp: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if gp:
        ref = gp["reference"]
        lines += [
            "## 4. Goodput under failure",
            "",
            "The hot-loop job trained for a fixed number of epochs ("
            + ", ".join(
                sorted(
                    {
                        f"{r['failure_free_train_s']:g} s of failure-free training at T = {r['period_s']:g} s"
                        for r in gp["runs"]
                        if "failure_free_train_s" in r
                    }
                )
            )
            + ") while the benchmark SIGKILLs a worker every T seconds from the first step on."
            f" The failure-free reference run: {f(ref['steps_per_s'], 1)} steps/s (validation included), one sync save"
            f" costs C = {f(ref['save_cost_s'], 4)} s; the default cadence (every 10 epochs) is"
            f" {f(gp['default_cadence']['seconds_of_training'], 1)} s of training here."
            " Goodput = the steps trained at the run's own failure-free speed (its median logged interval, with the"
            " reference's validation share: other tenants' load changes between runs), over the wall time from the first"
            " step to the end of training (the one cold start is in section 2); `incl. start` counts from the command."
            " Predicted: (1 - C/tau) (1 - (R + tau/2)/T) with the run's recovery R.",
            "",
        ]
        rows = [
            [
                f"{r['period_s']:g}",
                r["cadence"]
                + (f" (chose {', '.join(f(x, 2) + ' s' for x in r['auto_intervals_s'])})" if r.get("auto_intervals_s") else ""),
                f(r["goodput"], 2),
                f(r["goodput_incl_start"], 2),
                f(r["predicted_goodput"], 2),
                str(r["kills"]),
                f(r["recomputed_steps_median"], 0),
                f(r["recovery_median_s"], 2),
                sources_text(r.get("restored_from")) or "-",
                ("yes" if r["finished"] else "no (stopped at the cap)")
                + ("; no kill landed (done within T)" if not r["kills"] else ""),
            ]
            for r in gp["runs"]
        ]
        lines += table(
            [
                "T (s)",
                "checkpoint cadence",
                "goodput",
                "incl. start",
                "predicted",
                "kills",
                "steps recomputed per failure",
                "recovery (s)",
                "restored from",
                "finished",
            ],
            rows,
        )
    return lines
