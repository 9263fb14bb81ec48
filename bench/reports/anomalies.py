"""BENCHMARKS.md's rows and section 10, failures that crash nothing (bench.anomalies); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table, target


def rows(an: Optional[Dict[str, Any]]) -> List[List[str]]:
    if not an:
        return []
    inside, share = an["guard_us_per_step"], an["guard_share_of_step"]
    fp = an["fingerprint_default_share_of_step"]
    out = [
        target(
            "10",
            f"anomaly detection per step (the guard's calls timed around them, a CPU loss), share of the {an['job']} job's step",
            share["watched"],
            "<=",
            0.01,
            shown=f"{f(100 * share['watched'], 3)}% ({f(inside['watched'], 1)} us)",
            goal_text="< 1%",
        ),
        reported(
            "10",
            "replica fingerprint at the default interval (every 100 steps), share of a step",
            f"{f(100 * fp, 4)}% ({f(an['fingerprint_us'], 1)} us each)",
        ),
    ]
    rb = an.get("rollback")
    if rb:
        out.append(
            reported(
                "10",
                f"steps trained again after a NaN loss ({rb['job']} job, defaults: snapshots and intervals auto)",
                f"{rb['steps_trained_again']} ({f(rb['seconds_lost'], 3)} s)",
            )
        )
    return out


def section(an: Optional[Dict[str, Any]]) -> List[str]:
    if not an:
        return []
    lines = ["## 10. Failures that crash nothing (anomaly guard)", ""]
    lines += [
        f"`python -m bench.anomalies`: two workers train the {an['job']} job, blocks of {an['block_steps']} steps alternating"
        f" between configurations ({an['rounds']} rounds, rotated, medians; the stop agreement every"
        f" {an['agreement_every']} steps in all of them). `watched`: each step's loss into the guard, its verdict riding the"
        " control plane's message; `watched_gpu`: the device's path (a GPU's: losses judged a block at a time), here on the"
        " CPU; `fingerprint`: a fingerprint of the replicas every step (the default interval, 100, costs a hundredth).",
        "",
    ]
    header = ["configuration", "ms per step", "extra us per step", "share of a step", "CPU: extra us", "CPU: share"]
    body = [
        [
            k,
            f(an["ms_per_step"][k], 3),
            f(an["extra_us_per_step"][k], 1),
            f"{f(100 * an['share_of_step'][k], 2)}%",
            f(an["extra_cpu_us_per_step"][k], 1),
            f"{f(100 * an['cpu_share_of_step'][k], 2)}%",
        ]
        for k in an["ms_per_step"]
    ]
    lines += table(header, body)
    inside = an["guard_us_per_step"]
    lines += [
        "The block differences move by far more than the guard costs on this shared machine; timed around its own calls"
        " (rank 0, medians of blocks): " + ", ".join(f"`{k}` {f(v, 2)} us per step" for k, v in inside.items()) + ".",
        "",
    ]
    host, device = an.get("host") or {}, an.get("device") or {}
    lines += [
        f"The host's path alone (a CPU loss into the watch), timed in one process: {f(host.get('us_per_step'), 2)} us per"
        f" step. The device's path dispatches {f(device.get('ops_per_step'), 1)} tensor operations per step with a verdict every"
        f" {device.get('verdict_every')} steps (a kernel launch each on a GPU, none of them a read of a device value).",
        "",
    ]
    rb = an.get("rollback")
    if rb:
        lines += [
            f"A NaN loss at step {rb['nan_at_step']} on rank 1 of `python -m pipeline.train` ({rb['job']} job): agreed at step"
            f" {rb['agreed_at']}, every rank went back to step {rb['restored_step']} ({rb['source']}), {rb['steps_trained_again']}"
            f" steps trained again ({f(rb['seconds_lost'], 3)} s at {f((rb['seconds_per_step'] or 0) * 1e3, 2)} ms per step),"
            f" {rb['samples_skipped']} samples skipped.",
            "",
        ]
    return lines
