"""BENCHMARKS.md from bench/results/*.json: `python -m bench.report` (run_all calls it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import RESULTS, ROOT
from .reports import (
    anomalies,
    checkpoints,
    goodput,
    horovod,
    hot_loop,
    object_store,
    recovery,
    refactor,
    scaling,
    sharded,
    startup,
    step_cost,
)
from .reports.cells import f, load, table

OUT = ROOT / "BENCHMARKS.md"


def write_report(results: Path = RESULTS, out: Path = OUT) -> Path:
    run_all = load(results, "run_all") or {}
    ran = run_all.get("benchmarks", {})

    def this_run(name: str) -> Optional[Dict[str, Any]]:
        """A benchmark's figures, unless the suite skipped it or it failed (then its JSON may be an older run's)."""
        entry = ran.get(name)
        if entry is not None and (entry.get("form") == "skipped" or entry.get("error") or entry.get("exit_code")):
            return None
        return load(results, name)

    hot, st, rec, gp, ck, rf, s3, hv, sc, sa, sc_step, sc_alone, sh, fsdp, an = (
        this_run(n)
        for n in (
            "hot_loop",
            "startup",
            "recovery",
            "goodput",
            "checkpoint_io",
            "checkpoint_refactor",
            "checkpoint_s3",
            "horovod",
            "scaling",
            "stop_agreement",
            "step_cost",
            "step_cost_1rank",
            "sharded",
            "fsdp_hot_loop",
            "anomalies",
        )
    )
    m: Dict[str, Any] = run_all.get("machine") or next(
        (x["machine"] for x in (hot, st, rec, gp, ck, hv, sc) if x and "machine" in x), {}
    )
    lines: List[str] = ["# Benchmarks", ""]
    git = run_all.get("git", {})
    dirty = git.get("uncommitted_changes_in") or []
    lines += [
        f"Reproduce with `{run_all.get('command', 'make bench')}` (= `.venv/bin/{run_all.get('equivalent', 'python -m bench.run_all')}`);"
        f" the suite took {f(run_all.get('total_s'), 0)} s (budget {f(run_all.get('budget_s'), 0)} s)."
        f" Each script also runs alone (`python -m bench.<name> --help`); the raw figures are in `bench/results/*.json`.",
        "",
        f"Machine: {m.get('cpu_count')} x {m.get('cpu_model')}, torch {m.get('torch')}, Python {m.get('python')},"
        f" {m.get('platform')}. Run {run_all.get('started', '?')} at commit {git.get('commit', '?')}"
        + (f" with uncommitted changes in {len(dirty)} file(s) of pipeline/, launchers/." if dirty else "."),
        "",
        "Every figure is a ratio against a baseline measured in the same run, the two alternated in a"
        " rotated order, medians reported. The machine is shared with other test runs and noisy: each"
        " benchmark's JSON records, per run, how much CPU other tenants used (`foreign_share`).",
        "",
    ]
    earlier: Dict[str, List[str]] = {}  # benchmarks a partial run (--only) did not run: their run, and them
    for k, v in run_all.get("benchmarks", {}).items():
        if v.get("earlier_run"):
            e = v["earlier_run"]
            earlier.setdefault(f"`{e.get('command')}` of {e.get('started')} at commit {e.get('commit')}", []).append(k)
    if earlier:
        lines += [
            f"This run measured {', '.join(k for k, v in ran.items() if not v.get('earlier_run'))} only; the other figures are"
            " from earlier runs: " + "; ".join(f"{', '.join(names)} from {run}" for run, names in earlier.items()) + ".",
            "",
        ]
    forms = {k: v.get("form") for k, v in run_all.get("benchmarks", {}).items()}
    if any(v != "full" for v in forms.values()):
        lines += ["Forms that ran (quick/tiny forms have fewer rounds): " + ", ".join(f"{k} {v}" for k, v in forms.items()), ""]
    for k, v in run_all.get("benchmarks", {}).items():
        if v.get("form") == "skipped":
            lines += [f"**{k} was skipped**: {v.get('reason')}.", ""]
    errors = {k: v["error"] for k, v in run_all.get("benchmarks", {}).items() if v.get("error")}
    for k, v in errors.items():
        lines += [f"**{k} failed**: `{v.splitlines()[0][:300]}`", ""]

    rows: List[List[str]] = [
        *hot_loop.rows(hot),
        *startup.rows(st),
        *recovery.rows(rec),
        *goodput.rows(gp),
        *checkpoints.rows(ck),
        *horovod.rows(hv),
        *scaling.rows(sc),
        *step_cost.rows(sa, sc_step, sc_alone),
    ]
    rows += sharded.rows(sh, fsdp)
    rows += anomalies.rows(an)
    rows += refactor.rows(rf)
    rows += object_store.rows(s3)
    lines += ["## Figures against the targets", ""]
    lines += table(["#", "figure", "measured", "target", ""], rows)
    lines += hot_loop.section(hot)
    lines += startup.section(st)
    lines += recovery.section(rec, hot)
    lines += goodput.section(gp)
    lines += checkpoints.section(ck)
    lines += horovod.section(hv)
    lines += scaling.section(sc)
    lines += step_cost.section(sc_step, sa, sc_alone)
    if sh or fsdp:
        lines += sharded.section(sh, "sharded" in ran, fsdp)
    lines += anomalies.section(an)
    lines += refactor.section(rf)
    lines += object_store.section(s3)
    notes = Path(__file__).with_name("NOTES.md")
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
