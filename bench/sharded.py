"""Sharded state (FSDP2): save throughput per rank, rank 0's memory during a save, loading on another
world size, and the FSDP2 hot loop, each against its baseline in the same run.

    python -m bench.sharded [--rounds 2] [--width 2048] [--blocks 8] [--quick | --tiny] [--no-drop-caches] [--json PATH]

The state: an FSDP2 model (`--blocks` Linear layers of `--width` x `--width`, fully_shard applied to
each and to the whole model) and its AdamW optimizer after one step: 3 float32 tensors per parameter
(403 MB in all at the defaults). Real processes: groups of 1, 2 or 3 workers on Gloo, each worker a
process of its own (multiprocessing, forked from a forkserver that imported torch, FSDP2 and the
library once: under torchrun those imports cost 10-30 s per group on this loaded 2-core machine,
and no figure includes them), with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets
them; the saves and loads go through the real CheckpointManager and steadfast.distributed.comm.TorchDistComm.
Each round starts 5 groups (2 and 3 workers with each memory method, and 1 worker), in a rotated
order, so no group always runs first; `--rounds` rounds, medians reported.

1. Save throughput per rank (2 and 3 workers): a sharded save (CheckpointManager.save, synchronous:
   until it is committed; every rank writes, fsyncs and reads back its own file, rank 0 commits)
   against a raw fsync'd write in which every rank writes a file of the same size as its rank file
   (its pieces' bytes, padded), at the same time. The two alternate (ABAB) inside each group;
   before every timed write the previous one's files are removed, dirty pages flushed (os.sync)
   and, as root, the page cache dropped. A sample's time is its slowest rank's; throughput per rank
   is the mean rank file over that time; the ratio is the raw write's median time over the save's.
2. Rank 0's peak memory during a save, at 2 and 3 workers: `gathered` (what the replicated format
   did: torch.distributed.checkpoint.state_dict's get_model_state_dict and get_optimizer_state_dict
   with full_state_dict=True and cpu_offload=True gather the whole state on rank 0, which saves it
   through the CheckpointManager, replicated format) against `sharded` (the save above). Each is the
   first thing a fresh group of workers does after its training step, so neither inherits the
   other's freed memory: free heap memory is returned to the system (malloc_trim), the peak is reset
   (`5` written to /proc/self/clear_refs), and the peak is VmHWM after the save (and the background
   check: CheckpointManager.wait) minus VmRSS before it, in MB (10^6 bytes).
3. Load on another world size: a checkpoint saved by 2 workers restored (CheckpointManager.restore,
   into a fresh FSDP2 model and AdamW of that world size, no optimizer state yet) by 2, 3 and 1
   workers; cold (page cache dropped before each, as root) and warm. The ratio is a world size's
   median restore time over the 2-worker one's. The restored state is checked against the saved
   one (sums over every parameter and optimizer tensor). Bytes read: /proc/self/io rchar of each
   rank during the restore (every file is also verified whole, by one rank each).
4. The FSDP2 hot loop: `python -m pipeline.train parallel=fsdp trainer.optimizer=adamw` against
   bench/baseline_fsdp.py (fully_shard on every Linear and on the model, AdamW, batches sliced from
   the in-memory tensors) under `torchrun --nproc_per_node 2`, the hot-loop job of bench.hot_loop
   (MLP 256-512-512-4, batch 64 per worker, synthetic data), alternated in a rotated order each
   round; steps/s: the median logged 10-step interval after 30 warm-up steps (bench.common.steady_rate),
   and CPU seconds per step of every process of the run (the low-noise view).

Every group of workers and every hot-loop run records how much of the machine other tenants used
(`foreign_share`, bench.cpu.foreign_load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .sharded_workers import MB, Size, child, drop_caches, noop

TARGETS = {
    "save throughput per rank, sharded / raw fsync write (2 workers)": (">=", 0.9),
    "hot loop steps/s, ours / hand-written FSDP2": (">=", 0.97),
}
# "not growing with the ranks": the 3-worker sharded peak at most the 2-worker one (and 5 MB of slack
# for the allocator's rounding)
MEMORY_SLACK_MB = 5.0


PRELOAD = [  # fully_shard imports torch._dynamo on first use (2 s here)
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "steadfast.checkpoint.manager",
    "steadfast.distributed.comm",
]


class Groups:
    """Starts the groups of workers: processes forked from one forkserver that imported torch, FSDP2,
    torch.distributed.checkpoint and the library once (on this shared 2-core machine those imports
    took 10-30 s per group under torchrun; they are no part of what is measured)."""

    def __init__(self) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([*PRELOAD, "bench.sharded_workers"])
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        warm = self.ctx.Process(target=noop)  # the forkserver's imports happen here, outside every group
        warm.start()
        warm.join()

    def run(
        self, world: int, tasks: Sequence[str], size: Size, scratch: Path, ref: Path, drop: bool, timeout: float
    ) -> Dict[str, Any]:
        """One group of `world` workers running `tasks`: their results, the group's wall time and the machine's load."""
        import resource
        import socket

        from .cpu import cpu_counters, foreign_load

        out = scratch / f"result-{time.monotonic_ns()}.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        params = {
            "tasks": ",".join(tasks),
            "width": size.width,
            "blocks": size.blocks,
            "dir": str(scratch),
            "ref": str(ref),
            "out": str(out),
            "drop": drop,
        }
        counters, started = cpu_counters(), time.time()
        own = resource.getrusage(resource.RUSAGE_SELF)
        procs = [self.ctx.Process(target=child, args=(r, world, port, params)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        wall = time.time() - started
        codes = [p.exitcode for p in procs]
        if any(codes) or not out.exists():
            raise RuntimeError(f"sharded workers ({world}, {','.join(tasks)}) failed: exit codes {codes} (their output is above)")
        result = json.loads(out.read_text())
        out.unlink()
        mine = resource.getrusage(resource.RUSAGE_SELF)
        ours = result.pop("workers_cpu_s") + (mine.ru_utime + mine.ru_stime) - (own.ru_utime + own.ru_stime)
        return {**result, "wall_s": round(wall, 2), "load": foreign_load(counters, wall, ours)}

    def close(self) -> None:
        from multiprocessing import forkserver

        stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
        if stop is not None:  # the idle forkserver holds torch in memory; the suite goes on without it
            stop()


def plan(rounds: int, pairs: int, restores: int) -> List[List[Tuple[int, List[str]]]]:
    """The groups of workers of each round, in a rotated order (round 0 starts with the one that saves
    the checkpoint every restore reads)."""
    base: List[Tuple[int, List[str]]] = [
        (2, ["memory:gathered", "ref", f"throughput:{pairs}", f"restore:{restores}"]),
        (3, ["memory:sharded", f"throughput:{pairs}", f"restore:{restores}"]),
        (1, [f"restore:{restores}"]),
        (2, ["memory:sharded", f"throughput:{pairs}", f"restore:{restores}"]),
        (3, ["memory:gathered", f"throughput:{pairs}", f"restore:{restores}"]),
    ]
    out = []
    for r in range(rounds):
        groups = [(w, [t for t in tasks if t != "ref" or r == 0]) for w, tasks in base]
        k = r % len(groups)
        out.append(groups[k:] + groups[:k] if r else groups)
    return out


def summarize_state(groups: List[Dict[str, Any]], size: Size) -> Dict[str, Any]:
    from .common import median, ratio, spread

    by_world: Dict[int, List[Dict[str, Any]]] = {}
    for g in groups:
        by_world.setdefault(g["world_size"], []).append(g)
    res: Dict[str, Any] = {"throughput": {}, "memory": {}, "restore": {}}
    for world, gs in sorted(by_world.items()):
        tasks = [t for g in gs for t in g["tasks"]]
        tp = [t for t in tasks if t["task"] == "throughput"]
        if tp:
            save = [s["seconds"] for t in tp for s in t["sharded_save"]]
            raw = [s["seconds"] for t in tp for s in t["raw_fsync_write"]]
            per_rank = statistics.mean(tp[0]["rank_file_bytes"])
            med_save, med_raw = median(save), median(raw)
            res["throughput"][str(world)] = {
                "rank_file_bytes": tp[0]["rank_file_bytes"],
                "sharded_save_s": spread(save),
                "raw_fsync_write_s": spread(raw),
                "sharded_save_MB_per_s_per_rank": per_rank / MB / med_save if med_save else None,
                "raw_fsync_write_MB_per_s_per_rank": per_rank / MB / med_raw if med_raw else None,
                "sharded/raw throughput": ratio(med_raw, med_save),
                "sharded/raw throughput (median of pairs)": median(
                    [ratio(b["seconds"], a["seconds"]) for t in tp for a, b in zip(t["sharded_save"], t["raw_fsync_write"])]
                ),
            }
        mem = [t for t in tasks if t["task"] == "memory"]
        if mem:
            entry: Dict[str, Any] = {}
            for method in ("gathered", "sharded"):
                ms = [t for t in mem if t["method"] == method]
                if ms:
                    entry[method] = {
                        "rank0_peak_above_rss_MB": spread([t["peak_above_rss_MB"][0] for t in ms]),
                        "every_rank_peak_above_rss_MB (median)": [
                            median([t["peak_above_rss_MB"][r] for t in ms]) for r in range(world)
                        ],
                        "rank0_rss_before_MB": median([t["rss_before_MB"][0] for t in ms]),
                        "save_s": spread([t["seconds"] for t in ms]),
                        "checkpoint_bytes": ms[0]["bytes"],
                        "files": ms[0]["files"],
                        "peak_reset_ok": all(t["reset_ok"] for t in ms),
                    }
            g_peak = (entry.get("gathered") or {}).get("rank0_peak_above_rss_MB", {}).get("median")
            s_peak = (entry.get("sharded") or {}).get("rank0_peak_above_rss_MB", {}).get("median")
            entry["sharded/gathered rank0 peak"] = ratio(s_peak, g_peak)
            entry["sharded/gathered save time"] = ratio(
                (entry.get("sharded") or {}).get("save_s", {}).get("median"),
                (entry.get("gathered") or {}).get("save_s", {}).get("median"),
            )
            res["memory"][str(world)] = entry
        rs = [t for t in tasks if t["task"] == "restore"]
        if rs:
            entry = {"verified": all(t["verified"] for t in rs)}
            for mode in ("cold", "warm"):
                samples = [s for t in rs for s in t[mode]]
                if samples:
                    entry[f"{mode}_s"] = spread([s["seconds"] for s in samples])
                    entry[f"{mode}_rchar_MB_per_rank"] = [median([s["rchar"][r] / MB for s in samples]) for r in range(world)]
            res["restore"][str(world)] = entry
    for mode in ("cold", "warm"):
        base = (res["restore"].get("2", {}).get(f"{mode}_s") or {}).get("median")
        for entry in res["restore"].values():
            if f"{mode}_s" in entry:
                entry[f"/2 workers ({mode})"] = ratio(entry[f"{mode}_s"]["median"], base)
    two, three = res["memory"].get("2", {}), res["memory"].get("3", {})
    s2 = (two.get("sharded") or {}).get("rank0_peak_above_rss_MB", {}).get("median")
    s3 = (three.get("sharded") or {}).get("rank0_peak_above_rss_MB", {}).get("median")
    res["memory_vs_ranks"] = {
        "sharded rank0 peak, 3 / 2 workers": ratio(s3, s2),
        "sharded rank0 peak does not grow with the ranks": None if s2 is None or s3 is None else bool(s3 <= s2 + MEMORY_SLACK_MB),
        "slack_MB": MEMORY_SLACK_MB,
    }
    res["state"] = {
        "width": size.width,
        "blocks": size.blocks,
        "parameters": size.parameters(),
        "state_MB (parameters + AdamW)": round(size.state_MB(), 1),
    }
    return res


def hot_loop(rounds: int, job: Any, timeout: float = 600) -> Dict[str, Any]:
    """The built-in trainer with parallel=fsdp against bench/baseline_fsdp.py, alternated."""
    from .common import ROOT as REPO
    from .common import (
        Workdir,
        aborted_at_exit,
        alternate,
        check,
        cpu_per_step,
        fmt,
        foreign,
        log,
        median,
        ratio,
        run_baseline,
        run_ours,
        spread,
        steady_rate,
    )

    warm = min(30, job.steps_per_epoch() // 2)
    overrides = [*job.overrides(), "parallel=fsdp", "trainer.optimizer=adamw", "checkpoint.every_n_epochs=1000"]
    script = REPO / "bench" / "baseline_fsdp.py"
    with Workdir() as work:

        def on_run(name: str, r: int, run: Any) -> None:
            check(run, f"FSDP hot loop {name}")
            cpu = cpu_per_step(run, warm) or {}
            log(
                f"  round {r + 1} {name:<9} steps/s {fmt(steady_rate(run, warm), 1):>7}"
                f"  CPU ms/step {fmt((cpu.get('total_cpu_s_per_step') or 0) * 1e3, 2)}"
                f"  foreign {run.extra.get('load', {}).get('foreign_share', 0):.0%}  wall {run.wall:.1f} s"
            )

        runs = alternate(
            rounds,
            [
                (
                    "baseline",
                    lambda: run_baseline(work, "fsdp-baseline", job, timeout, sample_cpu=True, loader="slices", script=script),
                ),
                ("ours", lambda: run_ours(work, "fsdp-ours", overrides, timeout, sample_cpu=True)),
            ],
            on_run,
        )
    clean = {k: [steady_rate(r, warm) for r in v] for k, v in runs.items()}
    cpu = {k: [cpu_per_step(r, warm) or {} for r in v] for k, v in runs.items()}

    def cpu_med(k: str) -> Optional[float]:
        return median([c.get("total_cpu_s_per_step") for c in cpu[k]])

    ours, base = median(clean["ours"]), median(clean["baseline"])
    return {
        "job": job.describe(),
        "overrides": overrides,
        "rounds": rounds,
        "warmup_steps": warm,
        "steps_per_s (median interval)": {k: spread(v) for k, v in clean.items()},
        "cpu_ms_per_step": {k: spread([(c.get("total_cpu_s_per_step") or 0) * 1e3 for c in v]) for k, v in cpu.items()},
        "ttfs_s": {k: spread([r.ttfs() for r in v]) for k, v in runs.items()},
        "foreign_load": {k: foreign(v) for k, v in runs.items()},
        "baseline_aborted_at_exit": aborted_at_exit(runs["baseline"]),
        # snapshot.every_n_steps=auto: the interval each run of ours settled on (its last snapshot_interval event)
        "ours_snapshot_every_n_steps": [
            ([e.get("every_n_steps") for e in r.events if e.get("event") == "snapshot_interval"] or [None])[-1]
            for r in runs["ours"]
        ],
        "ours/baseline steps_per_s": ratio(ours, base),
        "ours/baseline steps_per_s (median of paired rounds)": median(
            [ratio(o, b) for o, b in zip(clean["ours"], clean["baseline"])]
        ),
        # each round's ratio (ours and the baseline ran back to back): their spread tells the code from the noise
        "ours/baseline steps_per_s, paired rounds": spread([ratio(o, b) for o, b in zip(clean["ours"], clean["baseline"])]),
        "ours/baseline steps per CPU-second": ratio(cpu_med("baseline"), cpu_med("ours")),
        "ours/baseline steps per CPU-second, paired rounds": spread(
            [ratio(b.get("total_cpu_s_per_step"), o.get("total_cpu_s_per_step")) for o, b in zip(cpu["ours"], cpu["baseline"])]
        ),
    }


def figures(state: Dict[str, Any], hot: Dict[str, Any]) -> Dict[str, Any]:
    """The headline ratios, named as TARGETS names them."""
    tp = state["throughput"]
    mem = state["memory"]
    rs = state["restore"]
    mode = "cold" if any("cold_s" in e for e in rs.values()) else "warm"
    out: Dict[str, Any] = {
        "save throughput per rank, sharded / raw fsync write (2 workers)": (tp.get("2") or {}).get("sharded/raw throughput"),
        "save throughput per rank, sharded / raw fsync write (3 workers)": (tp.get("3") or {}).get("sharded/raw throughput"),
        "hot loop steps/s, ours / hand-written FSDP2": hot.get("ours/baseline steps_per_s"),
        "hot loop steps per CPU-second, ours / hand-written FSDP2": hot.get("ours/baseline steps per CPU-second"),
        "sharded rank0 peak, 3 / 2 workers": state["memory_vs_ranks"]["sharded rank0 peak, 3 / 2 workers"],
    }
    for w in ("2", "3"):
        out[f"rank0 peak MB above RSS, sharded / gathered ({w} workers)"] = (mem.get(w) or {}).get("sharded/gathered rank0 peak")
    for w in ("1", "3"):
        out[f"restore time, saved on 2 loaded on {w} / on 2 ({mode})"] = (rs.get(w) or {}).get(f"/2 workers ({mode})")
    return out


def hot_report(hot: Dict[str, Any]) -> None:
    from .common import fmt

    sp = hot["steps_per_s (median interval)"]
    print(
        f"  FSDP hot loop: ours {fmt(sp['ours']['median'], 1)} steps/s, baseline {fmt(sp['baseline']['median'], 1)} steps/s"
        f"  CPU ms/step ours {fmt(hot['cpu_ms_per_step']['ours']['median'], 2)} baseline {fmt(hot['cpu_ms_per_step']['baseline']['median'], 2)}"
    )
    paired = hot.get("ours/baseline steps_per_s, paired rounds") or {}
    print(
        f"  per round, ours/baseline steps/s: median {fmt(paired.get('median'))} (min {fmt(paired.get('min'))},"
        f" max {fmt(paired.get('max'))}, {paired.get('n', 0)} rounds)"
    )


def report(out: Dict[str, Any]) -> None:
    from .common import fmt

    st, hot = out["state"], out["hot_loop"]
    print(
        f"\nSharded state: {st['state']['blocks']} x Linear({st['state']['width']}), "
        f"{st['state']['state_MB (parameters + AdamW)']} MB with AdamW; {out['rounds']} round(s); page cache: {out['page_cache']}"
    )
    for w, t in st["throughput"].items():
        print(
            f"  save, {w} workers: sharded {fmt(t['sharded_save_s']['median'], 3)} s ({fmt(t['sharded_save_MB_per_s_per_rank'], 0)} MB/s per rank)"
            f"  raw {fmt(t['raw_fsync_write_s']['median'], 3)} s ({fmt(t['raw_fsync_write_MB_per_s_per_rank'], 0)} MB/s per rank)"
            f"  sharded/raw throughput {fmt(t['sharded/raw throughput'])}"
        )
    for w, m in st["memory"].items():
        g, s = m.get("gathered") or {}, m.get("sharded") or {}
        print(
            f"  rank 0 peak above RSS, {w} workers: gathered {fmt((g.get('rank0_peak_above_rss_MB') or {}).get('median'), 1)} MB"
            f" ({fmt((g.get('save_s') or {}).get('median'), 2)} s)"
            f"  sharded {fmt((s.get('rank0_peak_above_rss_MB') or {}).get('median'), 1)} MB ({fmt((s.get('save_s') or {}).get('median'), 2)} s)"
        )
    for w, r in sorted(st["restore"].items()):
        print(
            f"  restore of a 2-worker checkpoint on {w}: "
            + "  ".join(
                f"{mode} {fmt(r[mode + '_s']['median'], 3)} s (/2 workers {fmt(r.get(f'/2 workers ({mode})'))})"
                for mode in ("cold", "warm")
                if mode + "_s" in r
            )
            + f"  read per rank {', '.join(fmt(x, 0) for x in r.get('warm_rchar_MB_per_rank', []))} MB (warm)"
        )
    if hot:
        hot_report(hot)
    for name, value in out["ratios"].items():
        target = ""
        if name in out["targets"]:
            op, goal = out["targets"][name]
            ok = value is not None and (value >= goal if op == ">=" else value <= goal)
            target = f"  (target {op} {goal}: {'met' if ok else 'MISSED'})"
        print(f"  {name:<72} {fmt(value)}{target}")
    grows = st["memory_vs_ranks"]["sharded rank0 peak does not grow with the ranks"]
    print(f"  sharded rank-0 peak does not grow from 2 to 3 workers: {grows}  (target: true)")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of the state measurements (5 groups of workers each)")
    p.add_argument("--pairs", type=int, default=2, help="save / raw write pairs per group")
    p.add_argument("--restores", type=int, default=2, help="restores per group (each cold and warm)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--hot-rounds", type=int, default=3, help="rounds of the FSDP2 hot loop (0: none; bench.fsdp_hot_loop)")
    p.add_argument("--quick", action="store_true", help="a state of 75 MB, 1 round; the hot loop on half the data, 2 rounds")
    p.add_argument("--tiny", action="store_true", help="a 3 MB state, 1 sample of each; a tiny hot loop (smoke test)")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache (warm restores only)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (a temporary folder is made inside)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from .common import HOT, RESULTS, command_line, log, machine, write_json
    from .run_all import git_state

    size, rounds, pairs, restores, hot_rounds = (
        Size(args.width, args.blocks),
        args.rounds,
        args.pairs,
        args.restores,
        args.hot_rounds,
    )
    job = dataclasses.replace(HOT, epochs=1)
    if args.quick:
        size, rounds, pairs, restores, hot_rounds = Size(1024, 6), 1, 3, 2, min(2, args.hot_rounds)
        job = dataclasses.replace(HOT, num_samples=HOT.num_samples // 2)
    if args.tiny:
        size, rounds, pairs, restores, hot_rounds = Size(256, 4), 1, 1, 1, min(1, args.hot_rounds)
        job = dataclasses.replace(HOT, num_samples=2048, num_features=16, hidden=(64, 64), log_every=2)
    drop = not args.no_drop_caches and drop_caches(True)
    log(
        f"sharded: a {size.state_MB():.0f} MB state, {rounds} round(s) of 5 groups of workers;"
        f" the FSDP hot loop {hot_rounds} round(s); page cache {'dropped' if drop else 'kept'}"
    )
    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="steadfast-bench-sharded-", dir=args.dir))
    groups: List[Dict[str, Any]] = []
    starter = Groups()
    try:
        for r, round_groups in enumerate(plan(rounds, pairs, restores)):
            for world, tasks in round_groups:
                g = starter.run(world, tasks, size, scratch, scratch / "saved-on-2", drop, timeout=900)
                groups.append(g)
                log(
                    f"  round {r + 1}: {world} worker(s) {','.join(tasks)}: {g['wall_s']} s, foreign {g['load']['foreign_share']:.0%}"
                )
    finally:
        starter.close()
        shutil.rmtree(scratch, ignore_errors=True)
    state = summarize_state(groups, size)
    state["groups"] = [
        {"world_size": g["world_size"], "wall_s": g["wall_s"], "load": g["load"], "tasks": g["tasks"]} for g in groups
    ]
    shares = [g["load"]["foreign_share"] for g in groups]
    state["foreign_load"] = {"median": statistics.median(shares), "max": max(shares), "n": len(shares)}
    hot = hot_loop(hot_rounds, job) if hot_rounds else {}  # 0: run_all measures it as fsdp_hot_loop, with more rounds
    out = {
        "benchmark": "sharded",
        "command": command_line("bench.sharded", argv),
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "git": git_state(),
        "page_cache": "dropped before every timed write and cold restore" if drop else "kept (not root, or --no-drop-caches)",
        "memory_measure": "/proc/self/status VmHWM after writing 5 to /proc/self/clear_refs, minus VmRSS before (after malloc_trim)",
        "rounds": rounds,
        "pairs_per_group": pairs,
        "restores_per_group": restores,
        "targets": {**TARGETS, "sharded rank0 peak does not grow with the ranks": "true"},
        "ratios": {},
        "state": state,
        "hot_loop": hot,
        "seconds": round(time.time() - started, 1),
        "foreign_load": {"state groups": state["foreign_load"], "hot loop": hot.get("foreign_load")},
    }
    out["ratios"] = figures(state, hot)
    report(out)
    write_json(args.json or RESULTS / "sharded.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
