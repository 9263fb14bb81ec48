"""BENCHMARKS.md's rows and section 11, checkpoint speed before and after the refactor (bench.checkpoint_refactor)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, table, target

SECTION = "11"
UNCHANGED = 0.95  # after / before at least this: unchanged, within the ±5% separate runs move by here


def rows(rf: Optional[Dict[str, Any]]) -> List[List[str]]:
    out: List[List[str]] = []
    if not rf or rf.get("skipped"):
        return out
    for case, t in rf["ratios"].items():
        label = case if case.startswith("sharded") else f"checkpoint {case}"
        what = f"{label}: save / raw write, after / before the refactor ({rf['before']['commit']}) (before; after; save time before / after)"
        before, after = t["before"]["save/raw throughput"], t["after"]["save/raw throughput"]
        shown = f"{f(t['after/before'], 3)} ({f(before)}; {f(after)}; save time {f(t['save time before/after'], 3)})"
        out.append(
            target(SECTION, what, t["after/before"], ">=", UNCHANGED, 3, shown=shown, goal_text=f">= {UNCHANGED} (unchanged)")
        )
    return out


def section(rf: Optional[Dict[str, Any]]) -> List[str]:
    if not rf:
        return []
    if rf.get("skipped"):
        return [f"## {SECTION}. Checkpoint speed before and after the refactor", "", f"Skipped: {rf['skipped']}.", ""]
    ck, sh = rf["checkpoint_io_args"], rf["sharded_args"]
    lines = [
        f"## {SECTION}. Checkpoint speed before and after the refactor",
        "",
        f"`{rf['command']}`: the tree before the worker side was regrouped and the Store interface came in"
        f" (`{rf['before']['rev']}` = {rf['before']['commit']}, checked out with `git worktree add --detach`) against this one"
        f" ({rf['after']['commit']}), each running its own benchmark code and library, alternated in a rotated order,"
        f" {rf['rounds']} round(s). Each run's figure is its own save / raw-write throughput ratio, so the machine's load"
        f" hits a tree's save and its raw write alike; a tree's figure pools every run's samples (median raw time / median"
        f" save time), and `save time before / after` compares the two trees' saves of the same bytes directly: `bench.checkpoint_io --mb {ck['mb']} --tensors {ck['tensors']}"
        f" --repeats {ck['repeats']}` (project_sync / raw_fsync_write) and a group of 2 workers saving a sharded FSDP2"
        f" state of {sh['blocks']} Linear({sh['width']}) layers with AdamW against raw fsync'd writes of the same bytes,"
        f" {sh['pairs']} pairs (sharded / raw).",
        "",
    ]
    lines += table(
        ["case", "before ratio", "after ratio", "after / before", "save time before / after", "per run: before", "after"],
        [
            [
                case,
                f(t["before"]["save/raw throughput"], 3),
                f(t["after"]["save/raw throughput"], 3),
                f(t["after/before"], 3),
                f(t["save time before/after"], 3),
                ", ".join(f(x, 3) for x in t["before"]["per_run"]),
                ", ".join(f(x, 3) for x in t["after"]["per_run"]),
            ]
            for case, t in rf["ratios"].items()
        ],
    )
    return lines
