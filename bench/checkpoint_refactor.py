"""Checkpoint speed before and after a refactor: the old tree's own benchmark code against the current one's, alternated.

    python -m bench.checkpoint_refactor [--before cc4e9b0~1] [--rounds 5] [--mb 64] [--repeats 5] [--b-repeats 30] [--quick | --tiny] [--json PATH]

The tree before the refactor (default: the last commit before the worker side was regrouped and the
Store interface came in, issue 35) is checked out with `git worktree add --detach` in a temporary
folder (removed at the end). Each round runs, in a rotated order, with each tree's own code (its
bench/ and its library: PYTHONPATH and the working folder are that tree):
  sync saves    bench.checkpoint_io's states A, B, C (`--mb MB --tensors N`), built by that tree's
                bench.checkpoint_io and saved by its manager, timed by bench/_sync_saves_of_tree.py (the
                same timing code for both trees): a fresh manager's first save, its next save, and a raw
                fsync'd write of the same bytes, REPEATS pairs (B: B_REPEATS), after one untimed save
  sharded_save  one group of 2 workers: that tree's bench.sharded `throughput` task (sharded saves
                against raw fsync'd writes of the same bytes, alternated; bench/_sharded_save_of_tree.py)
A tree's figure is its save / raw-write throughput ratio (first or next save / raw_fsync_write;
sharded / raw), every run's samples pooled (median raw time / median save time), so a change of the
machine's load hits a tree's save and its raw baseline alike; after / before divides the two trees'
figures. Both trees write the same bytes on the same machine, alternated, so their save times compare
directly too: `save time before/after` (above 1: the save after the refactor is faster), and for A, B, C
`save CPU before/after` (the saving process's CPU time, its fsync threads too: what the machine's load
moves least). "Unchanged" is judged on a manager's next save for A, B and C (JUDGED), the first save
reported beside it: since the refactor a manager's first save also records the state's layout, which
every later save reuses, so every save of a run but its first costs what the next save does, and the
first save's extra is paid once per manager. That is why bench.checkpoint_io holds B to its next save,
and it holds for every state here: most for C, whose many small tensors make the longest walk (its first
save costs more CPU than before the refactor, its next one less). The sharded save is judged on the
one save it has: each is a fresh manager's (that tree's own bench.sharded task).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from .common import PY, RESULTS, ROOT, command_line, fmt, log, machine, median, ratio, spread, write_json

BEFORE = "cc4e9b0~1"
SHARDED_DRIVER = Path(__file__).with_name("_sharded_save_of_tree.py")
SAVES_DRIVER = Path(__file__).with_name("_sync_saves_of_tree.py")
# The save each case's "unchanged" is judged on (the module's docstring says why); the sharded save has only a first.
JUDGED = {"A": "next save", "B": "next save", "C": "next save"}


def tree_env(tree: Path) -> Dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "launchers")])
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def check_imports(tree: Path) -> None:
    """The tree's library and benchmark code are what a run in it imports (not the installed worktree's)."""
    code = "import bench.checkpoint_io as b, steadfast.checkpoint.manager as m; print(b.__file__); print(m.__file__)"
    done = subprocess.run([PY, "-c", code], cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=120)
    files = done.stdout.split()
    if done.returncode or len(files) != 2 or not all(Path(f).resolve().is_relative_to(tree.resolve()) for f in files):
        raise RuntimeError(f"{tree}: its code is not what runs there: {done.stdout}{done.stderr[-2000:]}")


def sync_saves(tree: Path, mb: int, tensors: int, repeats: int, b_repeats: int, scratch: Path) -> Dict[str, Dict[str, Any]]:
    """Each case's first and next save / raw-write ratios of the run and its samples (seconds)."""
    out = scratch / "saves.json"
    cmd = [PY, str(SAVES_DRIVER), str(tree), str(mb), str(tensors), str(repeats), str(b_repeats), str(out)]
    done = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=900)
    if done.returncode or not out.exists():
        raise RuntimeError(f"sync saves in {tree} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return {
        case: {
            "ratio": ratio(median(s["raw_s"]), median(s["first_s"])),
            "next_ratio": ratio(median(s["raw_s"]), median(s["next_s"])),
            "save_s": s["first_s"],
            "next_s": s["next_s"],
            "cpu_s": s["first_cpu_s"],
            "next_cpu_s": s["next_cpu_s"],
            "raw_s": s["raw_s"],
        }
        for case, s in result.items()
    }


def sharded_save(tree: Path, width: int, blocks: int, pairs: int, drop: bool, scratch: Path) -> Dict[str, Any]:
    out = scratch / "sharded.json"
    cmd = [PY, str(SHARDED_DRIVER), str(tree), str(width), str(blocks), str(pairs), "1" if drop else "0", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=900)
    if done.returncode or not out.exists():
        raise RuntimeError(f"sharded save in {tree} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    task = json.loads(out.read_text())
    out.unlink()
    saves = [s["seconds"] for s in task["sharded_save"]]
    raws = [s["seconds"] for s in task["raw_fsync_write"]]
    return {
        "ratio": ratio(median(raws), median(saves)),
        "save_s": saves,
        "raw_s": raws,
        "foreign_share": task["load"]["foreign_share"],
    }


def pooled(runs: List[Dict[str, Any]], save: str = "save_s", cpu: str = "cpu_s", per_run: str = "ratio") -> Dict[str, Any]:
    """A tree's figure for one case and save: every run's samples pooled, median raw / median save (throughput).

    Pooled rather than a median of per-run ratios: a few samples per run, and the raw write's time is
    bimodal here (now and then twice as long, as a run's earlier writes are flushed), so one slow raw
    sample moved a run's ratio by 0.3 while the save's times of the two trees were the same."""
    saves = [s for run in runs for s in run[save]]
    raws = [s for run in runs for s in run["raw_s"]]
    out = {
        "save/raw throughput": ratio(median(raws), median(saves)),
        "save_s": spread(saves),
        "raw_s": spread(raws),
        "per_run": [run[per_run] for run in runs],
    }
    if all(cpu in run for run in runs):
        out["save_cpu_s"] = spread([s for run in runs for s in run[cpu]])
    return out


def compare(before: List[Dict[str, Any]], after: List[Dict[str, Any]], **keys: str) -> Dict[str, Any]:
    """One case's save in both trees: each tree's pooled figure, after / before, the save times (and CPU) before / after."""
    b, a = pooled(before, **keys), pooled(after, **keys)
    out = {
        "before": b,
        "after": a,
        "after/before": ratio(a["save/raw throughput"], b["save/raw throughput"]),
        "save time before/after": ratio(b["save_s"]["median"], a["save_s"]["median"]),
    }
    if "save_cpu_s" in a and "save_cpu_s" in b:
        out["save CPU before/after"] = ratio(b["save_cpu_s"]["median"], a["save_cpu_s"]["median"])
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=BEFORE, help="the commit before the refactor")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mb", type=int, default=64, help="states A and C in MiB (bench.checkpoint_io's)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="A's and C's saves / raw writes per run")
    p.add_argument("--b-repeats", type=int, default=30, help="B's saves / raw writes per run (a few ms each)")
    p.add_argument("--width", type=int, default=1024, help="the sharded state's Linear width (bench.sharded --quick's)")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--pairs", type=int, default=5, help="sharded save / raw write pairs per run")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache before the sharded writes")
    p.add_argument("--quick", action="store_true", help="2 rounds")
    p.add_argument("--tiny", action="store_true", help="1 round of tiny sizes (smoke test)")
    p.add_argument("--json", type=Path, default=RESULTS / "checkpoint_refactor.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 2
    if args.tiny:
        args.rounds, args.mb, args.tensors, args.repeats, args.b_repeats = 1, 4, 4, 1, 2
        args.width, args.blocks, args.pairs = 256, 4, 1
    drop = not args.no_drop_caches and os.geteuid() == 0
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode:  # a shallow clone, or a copy without its history
        reason = f"{args.before} is not in this repository's history (git: {rev.stderr.strip()[:200]})"
        print(f"checkpoint_refactor: skipped: {reason}")
        write_json(
            args.json,
            {
                "benchmark": "checkpoint_refactor",
                "command": command_line("bench.checkpoint_refactor", argv),
                "machine": machine(),
                "skipped": reason,
            },
        )
        return 0
    after_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    work = Path(tempfile.mkdtemp(prefix="steadfast-bench-refactor-"))
    before = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, capture_output=True, check=True)
    trees = {"before": before, "after": ROOT}
    runs: Dict[str, Dict[str, List[Any]]] = {"before": {}, "after": {}}
    try:
        for tree in trees.values():
            check_imports(tree)
        log(f"checkpoint speed before ({rev.stdout.strip()}) / after ({after_rev.stdout.strip()}): {args.rounds} round(s)")
        names = list(trees)
        for r in range(args.rounds):
            order = names[r % 2 :] + names[: r % 2]
            for name in order:
                cases = sync_saves(trees[name], args.mb, args.tensors, args.repeats, args.b_repeats, work)
                for case, run in cases.items():
                    runs[name].setdefault(case, []).append(run)
                shown = ", ".join(f"{c} {v['ratio']:.3f} / {v['next_ratio']:.3f}" for c, v in cases.items())
                log(f"  round {r + 1} {name:<6} first / next save / raw {shown}")
            for name in order:
                s = sharded_save(trees[name], args.width, args.blocks, args.pairs, drop, work)
                runs[name].setdefault("sharded save, 2 workers", []).append(s)
                log(f"  round {r + 1} {name:<6} sharded save / raw {s['ratio']:.3f} (foreign {s['foreign_share']:.0%})")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    table: Dict[str, Dict[str, Any]] = {}
    for case in runs["after"]:
        table[case] = compare(runs["before"][case], runs["after"][case])  # the first save (the sharded save's only)
        table[case]["judged on"] = JUDGED.get(case, "first save")
        if "next_s" in runs["after"][case][0]:
            table[case]["next save"] = compare(
                runs["before"][case], runs["after"][case], save="next_s", cpu="next_cpu_s", per_run="next_ratio"
            )
    out = {
        "benchmark": "checkpoint_refactor",
        "command": command_line("bench.checkpoint_refactor", argv),
        "machine": machine(),
        "before": {"rev": args.before, "commit": rev.stdout.strip()},
        "after": {"commit": after_rev.stdout.strip()},
        "rounds": args.rounds,
        "checkpoint_io_args": {"mb": args.mb, "tensors": args.tensors, "repeats": args.repeats, "b_repeats": args.b_repeats},
        "sharded_args": {"width": args.width, "blocks": args.blocks, "pairs": args.pairs, "page_cache_dropped": drop},
        "ratios": table,
        "runs": runs,
    }
    print(f"\n{'case':<38}{'before':>10}{'after':>10}{'after/before':>14}{'save time b/a':>15}{'save CPU b/a':>14}")
    for case, c in table.items():
        for save, t in [("first save", c), ("next save", c.get("next save"))]:
            if t is None:
                continue
            label = f"{case}, {save}{' (judged)' if save == c['judged on'] else ''}" if "next save" in c else case
            b, a = t["before"]["save/raw throughput"], t["after"]["save/raw throughput"]
            print(
                f"{label:<38}{fmt(b):>10}{fmt(a):>10}{fmt(t['after/before']):>14}{fmt(t['save time before/after']):>15}"
                f"{fmt(t.get('save CPU before/after')):>14}"
            )
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
