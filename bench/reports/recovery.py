"""BENCHMARKS.md's rows and section 3, recovery (bench.recovery), and the monitor interval it recommends; bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..common import median, sources_text
from .cells import f, reported, table, target


def recommend_interval(rec: Dict[str, Any], hot: Optional[Dict[str, Any]]) -> Tuple[Optional[float], str]:
    """The largest measured interval whose mean detection delay (interval/2) stays within 10% of the
    rest of a recovery, and whose polling costs at most 1% of a core.

    The CPU per poll is taken from the hot loop (the launcher's CPU share at the default 0.5 s: an
    upper bound, it also does other work), else from the traced agent calls (wall time: an upper
    bound too).
    """
    runs = [r for r in rec.get("runs", []) if r["variant"].startswith("interval-") and r["recovery_median_s"] is not None]
    if not runs:
        return None, "no recovery figures"

    def rest(r: Dict[str, Any]) -> Optional[float]:
        d = (r.get("split_median_s") or {}).get("detect (kill -> agent sees FAILED)")
        return r["recovery_median_s"] - d if d is not None and r["recovery_median_s"] is not None else None

    floor = median([rest(r) for r in runs])
    share = ((hot or {}).get("cpu_s_per_step", {}).get("ours", {}).get("launcher_cpu_share") or {}).get("median")
    poll = (
        share * 0.5 if share else median([r["agent_poll"].get("median_s_per_call") for r in rec["runs"] if r.get("agent_poll")])
    )

    def pick_for(rest_s: Optional[float]) -> Optional[float]:
        ok = [
            r["monitor_interval"]
            for r in runs
            if (rest_s is None or r["monitor_interval"] / 2 <= 0.1 * rest_s)
            and (poll is None or poll / r["monitor_interval"] <= 0.01)
        ]
        return max(ok) if ok else min(r["monitor_interval"] for r in runs)

    pick = pick_for(floor)
    fast = [rest(r) for r in rec["runs"] if r["variant"] == "fork" and rest(r) is not None]
    detect = {r["monitor_interval"]: (r.get("split_median_s") or {}).get("detect (kill -> agent sees FAILED)") for r in runs}
    why = (
        f"a recovery is {f(floor, 2)} s besides detection at the default start method; detection took "
        + ", ".join(f"{f(v, 2)} s at {k:g} s" for k, v in sorted(detect.items()))
        + " (it includes the agent SIGTERMing the surviving worker and waiting for it to exit, which is why it is not interval/2)"
        + (
            f"; polling costs at most {poll * 1e3:.1f} ms of CPU per poll ({poll / pick * 100:.2f}% of a core at {pick:g} s)"
            if poll and pick
            else ""
        )
    )
    if fast:
        why += (
            f". With fork's restarts ({f(median(fast), 2)} s besides detection) the same rule gives {pick_for(median(fast)):g} s"
        )
    return pick, why


def rows(rec: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if rec:
        d = rec["summary"].get("0.5") or next(iter(rec["summary"].values()), None)
        if d:
            rows.append(
                target(
                    "3",
                    "recovery (SIGKILL to next step) / cold time to first step, default (forkserver, monitor_interval 0.5 s, restored from "
                    + sources_text(d.get("restored_from"), "x")
                    + ")",
                    d["recovery/cold_ttfs"],
                    "<=",
                    0.15 if d.get("restored_from", {}).get("memory") else 0.25,
                    goal_text="<= 0.25; from memory <= 0.15",
                )
            )
            ok = d["succeeded"].split(" ")[0]
            a, b = (int(x) for x in ok.split("/"))
            rows.append(
                [
                    "3",
                    "restarts that succeeded",
                    d["succeeded"],
                    "20/20",
                    "**met**" if a == b >= 20 else "**missed**" if a < b else f"{a}/{b}: fewer than 20 measured",
                ]
            )
        for k, v in rec["summary"].items():
            if "(" in k:  # a variant
                name = k.split("(")[1].rstrip(")")
                how = "`snapshot.every_n_steps=0` (restored from disk)" if name == "disk" else f"`backend.start_method={name}`"
                rows.append(
                    reported(
                        "3",
                        f"recovery / cold start with {how} (see section 3)",
                        f(v["recovery/cold_ttfs"], 2),
                        f"reported ({v['succeeded']})",
                    )
                )
    return rows


def section(rec: Optional[Dict[str, Any]], hot: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if rec:
        cold = rec["cold_ttfs_s"]
        lines += [
            "## 3. Recovery",
            "",
            f"`fault=kill_rank fault.rank=1 fault.at_step={rec['kill_at_step']} fault.times=K` with a checkpoint every"
            f" {rec['checkpoint_every_n_steps']} steps: rank 1 SIGKILLs itself K times, each restart resumes from step"
            f" {rec['checkpoint_every_n_steps']}. Recovery = the restarted group's first step minus the kill. Cold time to first step"
            f" of the same runs: median {f(cold['median'], 2)} s. All recovery runs are traced (the tracer costs milliseconds).",
            "",
        ]
        rows = [
            [
                k,
                f(v["recovery_median_s"], 2),
                f(v.get("cold_ttfs_s"), 2),
                f(v["recovery/cold_ttfs"], 2),
                f(v["detect_median_s"], 2),
                v["succeeded"],
                sources_text(v.get("restored_from")) or "-",
            ]
            for k, v in rec["summary"].items()
        ]
        e = rec["estimated_interval_30"]
        rows.append(
            ["30 (estimated)", f(e["recovery_s"], 2), f(cold["median"], 2), f(e["recovery/cold_ttfs"], 2), "~15", "-", "-"]
        )
        lines += table(
            [
                "restart.monitor_interval (s)",
                "recovery (s, median)",
                "cold start (s)",
                "/ cold start",
                "detection (s)",
                "succeeded",
                "restored from",
            ],
            rows,
        )
        lines += [
            "The interval rows use the defaults (forkserver; snapshots in memory, so a restart restores the step before the"
            " kill from shared memory). Variants (same 0.5 s interval, each against its own"
            " cold start): `spawn` = `backend.start_method=spawn` (every restarted worker imports torch again), `fork` ="
            " `backend.start_method=fork` (copies of the launcher), `disk` = `snapshot.every_n_steps=0` (every restart reads"
            " the checkpoint on disk and recomputes the steps since it).",
            "",
        ]
        splits = [(r["variant"], r["split_median_s"]) for r in rec["runs"] if r["split_median_s"]]
        if splits:
            labels = list(splits[0][1])
            lines += table(
                ["recovery segment (s, median)", *[v for v, _ in splits]],
                [[lab, *[f(s.get(lab), 2) for _, s in splits]] for lab in labels],
            )
        pick, why = recommend_interval(rec, hot)
        lines += [
            f"Recommended `restart.monitor_interval`: **{f(pick, 1)} s** ({why}). The 30 s figure is estimated, not run:"
            f" {e['how']}.",
            "",
        ]
    return lines
