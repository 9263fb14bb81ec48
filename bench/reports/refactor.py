"""BENCHMARKS.md's rows and section 11, checkpoint speed before and after the refactor (bench.checkpoint_refactor)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .cells import f, reported, table, target

SECTION = "11"
UNCHANGED = 0.95  # after / before at least this: unchanged, within the ±5% separate runs move by here


SAVES = {"first save": "a fresh manager's first save", "next save": "a manager's next save"}


def saves(t: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """A case's saves and their figures: first and next (A, B, C), or the one save (the sharded save, older results)."""
    return [("first save", t)] + ([("next save", t["next save"])] if "next save" in t else [])


def rows(rf: Optional[Dict[str, Any]]) -> List[List[str]]:
    """Each case's save / raw ratio, after / before: the save it is judged on (bench.checkpoint_refactor's JUDGED:
    A's, B's and C's next save, the sharded save's only one) against "unchanged", the other save reported beside it."""
    out: List[List[str]] = []
    if not rf or rf.get("skipped"):
        return out
    for case, t in rf["ratios"].items():
        label = case if case.startswith("sharded") else f"checkpoint {case}"
        judged = t.get("judged on", "first save")
        for save, c in saves(t):
            named = f"{label}, {SAVES[save]}" if "next save" in t else label
            what = f"{named}: save / raw write, after / before the refactor ({rf['before']['commit']}) (before; after; save time before / after)"
            before, after = c["before"]["save/raw throughput"], c["after"]["save/raw throughput"]
            shown = f"{f(c['after/before'], 3)} ({f(before)}; {f(after)}; save time {f(c['save time before/after'], 3)})"
            if save == judged:
                out.append(
                    target(
                        SECTION, what, c["after/before"], ">=", UNCHANGED, 3, shown=shown, goal_text=f">= {UNCHANGED} (unchanged)"
                    )
                )
            else:
                out.append(reported(SECTION, what, shown))
    return out


def section(rf: Optional[Dict[str, Any]]) -> List[str]:
    if not rf:
        return []
    if rf.get("skipped"):
        return [f"## {SECTION}. Checkpoint speed before and after the refactor", "", f"Skipped: {rf['skipped']}.", ""]
    ck, sh = rf["checkpoint_io_args"], rf["sharded_args"]
    if "b_repeats" in ck:
        states = (
            f"bench.checkpoint_io's states A, B, C (`--mb {ck['mb']} --tensors {ck['tensors']}`), built by each tree's own"
            " bench.checkpoint_io and saved by its manager, timed by the same code in both trees"
            f" (bench/_sync_saves_of_tree.py): a fresh manager's first save, its next save and a raw fsync'd write of the"
            f" same bytes, {ck['repeats']} of each per run ({ck['b_repeats']} for B), after one untimed save (save /"
            " raw_fsync_write; `save CPU before / after`: the saving process's CPU time)"
        )
        on_next = [case for case, t in rf["ratios"].items() if t.get("judged on") == "next save"]
        judged = (
            f' "Unchanged" is judged on a manager\'s next save for {", ".join(on_next) or "none"}, the first save reported'
            " beside it: since the refactor a manager's first save also records the state's layout, which every later save"
            " reuses, so every save of a run but its first costs what the next save does (why bench.checkpoint_io holds B"
            " to its next save; C's many tensors make the longest walk). The others are judged on a fresh manager's first"
            " save (the sharded save's only one)."
        )
    else:  # an older result: each tree's bench.checkpoint_io, its project_sync alone
        states = f"`bench.checkpoint_io --mb {ck['mb']} --tensors {ck['tensors']} --repeats {ck['repeats']}` (project_sync / raw_fsync_write)"
        judged = ""
    lines = [
        f"## {SECTION}. Checkpoint speed before and after the refactor",
        "",
        f"`{rf['command']}`: the tree before the worker side was regrouped and the Store interface came in"
        f" (`{rf['before']['rev']}` = {rf['before']['commit']}, checked out with `git worktree add --detach`) against this one"
        f" ({rf['after']['commit']}), each running its own benchmark code and library, alternated in a rotated order,"
        f" {rf['rounds']} round(s). Each run's figure is its own save / raw-write throughput ratio, so the machine's load"
        f" hits a tree's save and its raw write alike; a tree's figure pools every run's samples (median raw time / median"
        f" save time), and `save time before / after` compares the two trees' saves of the same bytes directly: {states}"
        f" and a group of 2 workers saving a sharded FSDP2 state of {sh['blocks']} Linear({sh['width']}) layers with AdamW"
        f" against raw fsync'd writes of the same bytes, {sh['pairs']} pairs (sharded / raw, a fresh manager's first"
        f" save).{judged}",
        "",
    ]
    lines += table(
        [
            "case",
            "save",
            "before ratio",
            "after ratio",
            "after / before",
            "save time before / after",
            "save CPU before / after",
            "per run: before",
            "after",
        ],
        [
            [
                case,
                save + (" (judged)" if save == t.get("judged on", "first save") else ""),
                f(c["before"]["save/raw throughput"], 3),
                f(c["after"]["save/raw throughput"], 3),
                f(c["after/before"], 3),
                f(c["save time before/after"], 3),
                f(c.get("save CPU before/after"), 3),
                ", ".join(f(x, 3) for x in c["before"]["per_run"]),
                ", ".join(f(x, 3) for x in c["after"]["per_run"]),
            ]
            for case, t in rf["ratios"].items()
            for save, c in saves(t)
        ],
    )
    return lines
