"""BENCHMARKS.md's rows and section 5, checkpoint throughput (bench.checkpoint_io); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table, target

# Each case's save against its limit (bench/checkpoint_io.py's TARGETS): A and C a fresh manager's first save
# against one fsync'd write of the bytes, B (0.1 MiB: its fsyncs are its cost) a manager's next save against
# a minimal atomic commit of them with a manifest (the first save, and the commit without one, are reported).
SAVE_GOALS = {
    "A": ("project_sync", "raw_fsync_write", 0.9),
    "B": ("project_sync_next", "raw_atomic_commit_manifest", 0.8),
    "C": ("project_sync", "raw_fsync_write", 0.8),
}
SAVES = {"project_sync": "project sync save", "project_sync_next": "project sync save, a manager's next"}
LIMITS = {
    "raw_fsync_write": "raw fsync write",
    "raw_atomic_commit": "minimal atomic commit (raw_atomic_commit)",
    "raw_atomic_commit_manifest": "minimal atomic commit with a manifest (raw_atomic_commit_manifest)",
}
ASYNC_GOAL = "<= max(0.05 x sync, 2 ms)"


def rows(ck: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if ck:
        for case in ck.get("results", []):
            rr = case["ratios"]
            tag = case["case"].split(":")[0]
            held, against, goal = SAVE_GOALS.get(tag, ("project_sync", "raw_fsync_write", 0.8))
            if rr.get(f"{held}/{against} throughput") is None:  # a result from before the next save was held to it
                held = "project_sync"
            for save, limit in [("project_sync", limit) for limit in LIMITS] + [(held, against)] * (held != "project_sync"):
                value = rr.get(f"{save}/{limit} throughput")
                goal_here = save == held and limit == against
                if value is None and not goal_here:  # a result from before raw_atomic_commit existed
                    continue
                what = f"checkpoint {tag}: {SAVES[save]} / {LIMITS[limit]}, throughput"
                rows.append(target("5", what, value, ">=", goal) if goal_here else reported("5", what, f(value, 2)))
            blocked = (case["methods"].get("async_blocked") or {}).get("median_s")
            allowed = rr.get("async_blocked/allowed time")
            share = f(rr.get("async_blocked/sync_save time"), 3)
            if allowed is None:  # an older result: the target was 0.05 of a sync save alone
                rows.append(
                    target(
                        "5",
                        f"checkpoint {tag}: async save, time blocked / sync save time",
                        rr.get("async_blocked/sync_save time"),
                        "<=",
                        0.05,
                        3,
                    )
                )
            else:
                rows.append(
                    target(
                        "5",
                        f"checkpoint {tag}: async save, time blocked / sync save time (ms blocked)",
                        allowed,
                        "<=",
                        1.0,
                        shown=f"{share} ({f((blocked or 0) * 1e3, 2)} ms)",
                        goal_text=ASYNC_GOAL,
                    )
                )
            rows.append(
                reported(
                    "5",
                    f"checkpoint {tag}: restore (load + verify) / raw read, throughput (warm)",
                    f(rr.get("restore/raw_read throughput (warm)"), 2),
                )
            )
    return rows


def section(ck: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if ck:
        lines += [
            "## 5. Checkpoint throughput",
            "",
            f"`{ck['command']}` ({ck.get('reads', '')}); medians of {ck['results'][0]['repeats']} rotated repeats."
            " `raw_fsync_write`: the tensors' bytes in one file, one fsync; `raw_atomic_commit`: the same file in a"
            " temporary folder, the file and the folder fsynced, the folder renamed into place, its parent fsynced (the"
            " least a checkpoint that appears whole or not at all costs; no manifest, no checksum);"
            " `raw_atomic_commit_manifest`: that and a small manifest naming the file's size and checksum, written"
            " after it and fsynced (the least the project's commit protocol allows). Async target:"
            f" {ck.get('async_target', 'blocked <= 0.05 x sync save')}.",
            "",
        ]
        for case in ck["results"]:
            lines += [f"{case['case']} ({case['payload_bytes'] / 2**20:.1f} MiB):", ""]
            lines += table(
                ["method", "median s", "MiB/s"],
                [[k, f(v["median_s"], 4), f(v["MiB_per_s"], 0)] for k, v in case["methods"].items()],
            )
    return lines
