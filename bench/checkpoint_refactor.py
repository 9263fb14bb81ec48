"""Checkpoint speed before and after a refactor: the old tree's own benchmark code against the current one's, alternated.

    python -m bench.checkpoint_refactor [--before cc4e9b0~1] [--rounds 5] [--mb 64] [--repeats 2] [--quick | --tiny] [--json PATH]

The tree before the refactor (default: the last commit before the worker side was regrouped and the
Store interface came in, issue 35) is checked out with `git worktree add --detach` in a temporary
folder (removed at the end). Each round runs, in a rotated order, with each tree's own code (its
bench/ and its library: PYTHONPATH and the working folder are that tree):
  checkpoint_io  `python -m bench.checkpoint_io --mb MB --repeats R --no-drop-caches` (cases A, B, C)
  sharded_save   one group of 2 workers: that tree's bench.sharded `throughput` task (sharded saves
                 against raw fsync'd writes of the same bytes, alternated; bench/_sharded_save_of_tree.py)
A tree's figure is its save / raw-write throughput ratio (project_sync / raw_fsync_write; sharded /
raw), every run's samples pooled (median raw time / median save time), so a change of the machine's
load hits a tree's save and its raw baseline alike; after / before divides the two trees' figures.
Both trees write the same bytes on the same machine, alternated, so their save times compare
directly too: `save time before/after` (above 1: the save after the refactor is faster).
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


def checkpoint_io(tree: Path, mb: int, tensors: int, repeats: int, scratch: Path) -> Dict[str, Dict[str, Any]]:
    """Each case's run ratio and its save / raw-write samples (seconds)."""
    out = scratch / "checkpoint_io.json"
    cmd = [PY, "-m", "bench.checkpoint_io", "--mb", str(mb), "--tensors", str(tensors), "--repeats", str(repeats)]
    cmd += ["--no-drop-caches", "--dir", str(scratch), "--json", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=900)
    if done.returncode or not out.exists():
        raise RuntimeError(
            f"checkpoint_io in {tree} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    result = json.loads(out.read_text())
    out.unlink()
    return {
        r["case"].split(":")[0]: {
            "ratio": r["ratios"]["project_sync/raw_fsync_write throughput"],
            "save_s": r["methods"]["project_sync"]["samples_s"],
            "raw_s": r["methods"]["raw_fsync_write"]["samples_s"],
        }
        for r in result["results"]
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


def pooled(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A tree's figure for one case: every run's samples pooled, median raw / median save (throughput).

    Pooled rather than a median of per-run ratios: a few samples per run, and the raw write's time is
    bimodal here (now and then twice as long, as a run's earlier writes are flushed), so one slow raw
    sample moved a run's ratio by 0.3 while the save's times of the two trees were the same."""
    saves = [s for run in runs for s in run["save_s"]]
    raws = [s for run in runs for s in run["raw_s"]]
    return {
        "save/raw throughput": ratio(median(raws), median(saves)),
        "save_s": spread(saves),
        "raw_s": spread(raws),
        "per_run": [run["ratio"] for run in runs],
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=BEFORE, help="the commit before the refactor")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mb", type=int, default=64, help="checkpoint_io's state A and C in MiB")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="checkpoint_io's repeats per run")
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
        args.rounds, args.mb, args.tensors, args.repeats, args.width, args.blocks, args.pairs = 1, 4, 4, 1, 256, 4, 1
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
                cases = checkpoint_io(trees[name], args.mb, args.tensors, args.repeats, work)
                for case, run in cases.items():
                    runs[name].setdefault(case, []).append(run)
                log(f"  round {r + 1} {name:<6} checkpoint_io " + ", ".join(f"{c} {v['ratio']:.3f}" for c, v in cases.items()))
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
        b, a = pooled(runs["before"][case]), pooled(runs["after"][case])
        table[case] = {
            "before": b,
            "after": a,
            "after/before": ratio(a["save/raw throughput"], b["save/raw throughput"]),
            "save time before/after": ratio(b["save_s"]["median"], a["save_s"]["median"]),
        }
    out = {
        "benchmark": "checkpoint_refactor",
        "command": command_line("bench.checkpoint_refactor", argv),
        "machine": machine(),
        "before": {"rev": args.before, "commit": rev.stdout.strip()},
        "after": {"commit": after_rev.stdout.strip()},
        "rounds": args.rounds,
        "checkpoint_io_args": {"mb": args.mb, "tensors": args.tensors, "repeats": args.repeats},
        "sharded_args": {"width": args.width, "blocks": args.blocks, "pairs": args.pairs, "page_cache_dropped": drop},
        "ratios": table,
        "runs": runs,
    }
    print(f"\n{'case':<26}{'before':>10}{'after':>10}{'after/before':>14}{'save time b/a':>15}")
    for case, c in table.items():
        b, a = c["before"]["save/raw throughput"], c["after"]["save/raw throughput"]
        print(f"{case:<26}{fmt(b):>10}{fmt(a):>10}{fmt(c['after/before']):>14}{fmt(c['save time before/after']):>15}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
