"""BENCHMARKS.md's rows and section 7, scaling (bench.scaling); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table, target


def rows(sc: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if sc:
        for k, v in sc.get("workers", {}).items():
            oversubscribed = " (oversubscribed)" if v.get("note") else ""
            rows.append(
                reported("7", f"{k} worker(s): steps/s ours / baseline{oversubscribed}", f(v["ours/baseline steps_per_s"], 3))
            )
        for k, v in sc.get("model_size", {}).items():
            tiny = k == "tiny"  # short steps: the library's fixed per-step work is the largest share (issue 25)
            rows.append(
                target(
                    "7",
                    f"{k} model ({v['job']['parameter_MB']} MB of parameters): steps/s ours / baseline; time to first step",
                    v["ours/baseline steps_per_s"],
                    ">=",
                    0.95 if tiny else None,
                    shown=f"{f(v['ours/baseline steps_per_s'], 3)}; {f(v['ours/baseline ttfs'], 2)}",
                    goal_text=">= 0.95 (steps/s)",
                )
            )
    return rows


def _case(label: str, v: Dict[str, Any], speed_digits: int) -> List[str]:
    """A case's row: steps/s and time to first step, ours and the baseline's, and their ratios."""
    speed, ttfs = v["steps_per_s"], v["ttfs_s"]
    return [
        label,
        f(speed["ours"]["median"], speed_digits),
        f(speed["baseline"]["median"], speed_digits),
        f(v["ours/baseline steps_per_s"], 3),
        f(ttfs["ours"]["median"], 2),
        f(ttfs["baseline"]["median"], 2),
        f(v["ours/baseline ttfs"], 2),
    ]


def section(sc: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if sc:
        lines += [
            "## 7. Scaling",
            "",
            "Ours / baseline at other sizes (2 workers and the hot-loop job: section 1)."
            " 4 workers on 2 cores are oversubscribed (2 processes per core): that row shows the cost under contention.",
            "",
        ]
        rows = [_case(f"{k} worker(s), hot-loop job", v, 1) for k, v in sc.get("workers", {}).items()]
        rows += [_case(f"{k} model, {v['job']['parameter_MB']} MB", v, 2) for k, v in sc.get("model_size", {}).items()]
        lines += table(["case", "ours steps/s", "baseline steps/s", "ratio", "ours ttfs (s)", "baseline ttfs (s)", "ratio"], rows)
        bc = sc.get("big_checkpoint_and_recovery")
        if bc:
            slow = bc.get(next((k for k in bc if k.startswith("ckpt every")), ""))
            lines += [
                f"Big model with a sync checkpoint every {bc['checkpoint_every_n_steps']} steps ({f((bc['checkpoint_bytes'] or 0) / 1e6, 0)} MB each):"
                f" {f(bc['sync_save_s'], 2)} s per save; steps/s with checkpoints / without (same run) {f(slow, 3)};"
                f" recovery after a kill {f(bc['recovery_s'], 2)} s vs cold start {f(bc['cold_ttfs_s'], 2)} s"
                f" = {f(bc['recovery/cold_ttfs'], 2)}.",
                "",
            ]
    return lines
