"""BENCHMARKS.md's rows and section 8, the per-step cost and the stop agreement (bench.step_cost, bench.stop_agreement); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table, target


def rows(
    sa: Optional[Dict[str, Any]], sc_step: Optional[Dict[str, Any]], alone: Optional[Dict[str, Any]] = None
) -> List[List[str]]:
    """`alone`: bench.step_cost --nproc 1 (one rank, a core to itself), where run.step's target is measured."""
    rows: List[List[str]] = []
    if sa:
        t = sa.get("in_training", {})
        for label in ("auto (default)", "every step"):
            if label in t:
                rows.append(
                    reported(
                        "8",
                        f"stop agreement, {label}: steps/s with / without it (CPU-second view)",
                        f"{f(t[label]['speed vs without'], 3)} ({f(t[label]['speed per CPU-second vs without'], 3)})",
                    )
                )
    if sc_step:
        v = sc_step["bare/config steps_per_s"].get("run_step")
        rows.append(
            reported(
                "8",
                "the library's per-step work (steadfast.Run.step's pieces): steps/s with / without, inside one run",
                f"{f(v, 3)} ({f(sc_step['bare/config steps per CPU-second'].get('run_step'), 3)} per CPU-second)",
            )
        )
    median = (alone or {}).get("run.step_us_per_step")
    direct = (alone or {}).get("run.step_us_per_step_amortised")
    rows.append(
        target(
            "8",
            "run.step timed around the call, amortised over every step (one rank alone, hot job: the mean of each"
            " launch's blocks, the median of the launches; the median of blocks, which leaves out the control"
            " plane's messages, beside it)",
            direct,
            "<=",
            20.0,
            shown=None if direct is None else f"{f(direct, 1)} us (median {f(median, 1)} us)",
            goal_text="<= 20 us",
        )
    )
    if alone and "run" in alone["ms_per_step"]:
        rows.append(
            reported(
                "8",
                "the same rank alone: steadfast.Run's loop / bare loop, steps/s (per CPU-second), alternated blocks",
                f"{f(alone['bare/config steps_per_s']['run'], 3)} ({f(alone['bare/config steps per CPU-second']['run'], 3)})",
            )
        )
    if sc_step and sc_step.get("run.step_us_per_step") is not None:
        rows.append(
            reported(
                "8",
                "run.step timed around the call, rank 0 of 2 on the 2 cores (Gloo's threads and the other rank compete)",
                f"{f(sc_step['run.step_us_per_step'], 1)} us",
            )
        )
    if sc_step and "run" in sc_step["ms_per_step"]:
        extra = sc_step["extra_us_per_step"]["run"]
        rows.append(
            reported(
                "8",
                "steadfast.Run itself (its loader, hooks and run.step) inside one run: extra us per step over `bare`"
                " (steps/s with / without; per CPU-second)",
                f"{f(extra, 1)} ({f(sc_step['bare/config steps_per_s']['run'], 3)};"
                f" {f(sc_step['bare/config steps per CPU-second']['run'], 3)})",
                "reported (block differences move by ~100 us here)",
            )
        )
    if sc_step and sc_step.get("snapshot"):
        sn = sc_step["snapshot"]
        rows.append(
            target(
                "8",  # bench.step_cost's figure (section 8)
                f"a snapshot in memory ({f((sn.get('bytes_per_node') or 0) / 1e6, 1)} MB per node): its cost per step at"
                f" `snapshot.every_n_steps=auto` (every {sn['auto_every_n_steps']} step(s)); every step",
                sn["auto_share_of_step"],
                "<=",
                0.02,
                shown=f"{100 * sn['auto_share_of_step']:.2f}%; {100 * sn['every_step_share_of_step']:.1f}%",
                goal_text="<= 2% at the default",
            )
        )
    return rows


def section(sc_step: Optional[Dict[str, Any]], sa: Optional[Dict[str, Any]], alone: Optional[Dict[str, Any]] = None) -> List[str]:
    lines: List[str] = []
    if sc_step or sa or alone:
        lines += ["## 8. Per-step cost and the stop agreement", ""]
    if alone:
        fetch = alone.get("fetch_us_per_step", {})
        per_process = ", ".join(f"{f(v, 1)}" for v in alone.get("run.step_us_per_step_amortised_per_process", [])) or "one"
        lines += [
            f"`{alone.get('command', 'python -m bench.step_cost --nproc 1')}`: the same harness with one rank alone (world"
            f" size 1, a core to itself), blocks of {alone['block_steps']} steps alternating `bare` and `run`,"
            f" {alone['rounds']} rounds, in {alone.get('processes', 1)} launch(es) one after the other, medians of the"
            " blocks. run.step timed around the call:"
            f" **{f(alone.get('run.step_us_per_step_amortised'), 1)} us per step** amortised (the mean of each launch's"
            f" blocks, {per_process}, and the median of those; the median of the blocks, without the control"
            f" plane's messages, {f(alone.get('run.step_us_per_step'), 1)} us)"
            f" (a batch: {f(fetch.get('bare'), 1)} us sliced,"
            f" {f(fetch.get('run'), 1)} us from run.loader).",
            "",
        ]
        lines += table(
            ["configuration", "ms per step", "extra us per step", "speed vs bare", "CPU ms per step", "per CPU-second vs bare"],
            [
                [
                    k,
                    f(v, 3),
                    f(alone["extra_us_per_step"][k], 1),
                    f(alone["bare/config steps_per_s"][k], 3),
                    f(alone["cpu_ms_per_step (both workers)"][k], 3),
                    f(alone["bare/config steps per CPU-second"][k], 3),
                ]
                for k, v in alone["ms_per_step"].items()
            ],
        )
    if sc_step:
        lines += [
            f"`python -m bench.step_cost`: two workers train the hot-loop job and switch every {sc_step['block_steps']} steps between"
            f" configurations, in a rotated order, {sc_step['rounds']} rounds, inside one pair of processes (so other tenants' load"
            " hits every configuration alike); medians of the blocks; CPU = both workers' processes, every thread. `bare`:"
            " batches indexed out of the tensors, forward, backward, SGD; `loader`: the library's loader, `dataloader`:"
            " torch's DataLoader; `run_step`: the pieces of steadfast.Run.step (loader, heartbeat, loss window every 10"
            " steps, riding the control plane's message, sent at its automatic interval: every"
            f" {sc_step['agreement_every']} steps here); `run`: steadfast.Run itself, as a loop uses it (its message every"
            f" {sc_step.get('run_agreement_every', '?')} steps); `NAME@N`: the message every N steps.",
            "",
        ]
        lines += table(
            [
                "configuration",
                "ms per step",
                "extra us per step",
                "speed vs bare",
                "CPU ms per step",
                "extra CPU us",
                "per CPU-second vs bare",
            ],
            [
                [
                    k,
                    f(v, 3),
                    f(sc_step["extra_us_per_step"][k], 1),
                    f(sc_step["bare/config steps_per_s"][k], 3),
                    f(sc_step["cpu_ms_per_step (both workers)"][k], 3),
                    f(sc_step["extra_cpu_us_per_step"][k], 1),
                    f(sc_step["bare/config steps per CPU-second"][k], 3),
                ]
                for k, v in sc_step["ms_per_step"].items()
            ],
        )
    if sa:
        c = sa.get("collective", {})
        lines += [
            "`python -m bench.stop_agreement`: the all-reduce of two floats, waited for at once: "
            + "; ".join(f"{k} median {f(v['median_us'], 0)} us, p90 {f(v['p90_us'], 0)} us" for k, v in c.items())
            + ". In training (the same harness; the agreement is pipelined, so only its cost shows, not its latency):",
            "",
        ]
        t = sa.get("in_training", {})
        lines += table(
            ["agreement", "extra us per step", "speed with / without", "extra CPU us per step", "per CPU-second"],
            [
                [
                    k,
                    f(t[k]["extra_us_per_step"], 1),
                    f(t[k]["speed vs without"], 3),
                    f(t[k]["extra_cpu_us_per_step"], 1),
                    f(t[k]["speed per CPU-second vs without"], 3),
                ]
                for k in ("every step", "auto (default)", "never")
                if k in t
            ],
        )
        lines += [
            f"Auto chose every {t.get('auto_every_n_steps')} steps here (a step without it: {f(t.get('bare_ms_per_step'), 2)} ms).",
            "",
        ]
    return lines
