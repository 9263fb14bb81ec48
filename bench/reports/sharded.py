"""BENCHMARKS.md's rows and section 9, sharded state (bench.sharded, FSDP2); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import SPEED_COLUMNS, f, reported, spread, table, target

SECTION = "9"


def _med(d: Optional[Dict[str, Any]], *keys: str) -> Optional[float]:
    for k in keys:
        d = (d or {}).get(k)
    return d.get("median") if isinstance(d, dict) else None


def hot_of(sh: Optional[Dict[str, Any]], fsdp: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The FSDP2 hot loop's figures: bench.fsdp_hot_loop's (more rounds) where it ran, else bench.sharded's."""
    return (fsdp or {}).get("hot_loop") or (sh or {}).get("hot_loop") or None


def rows(sh: Optional[Dict[str, Any]], fsdp: Optional[Dict[str, Any]] = None) -> List[List[str]]:
    """The summary table's rows."""
    out = state_rows(sh) if sh else []
    hot = hot_of(sh, fsdp)
    if hot:
        paired = hot.get("ours/baseline steps_per_s, paired rounds") or {}
        v = hot.get("ours/baseline steps_per_s")
        shown = f(v, 3) + (
            f" (per round: median {f(paired.get('median'), 3)}, {f(paired.get('min'), 3)}..{f(paired.get('max'), 3)},"
            f" {paired.get('n')} rounds)"
            if paired.get("n")
            else ""
        )
        out.append(
            target(
                SECTION,
                "FSDP2 hot loop: steps/s, ours (parallel=fsdp) / hand-written FSDP2 loop (wall clock)",
                v,
                ">=",
                0.97,
                3,
                shown=shown,
            )
        )
        v = hot.get("ours/baseline steps per CPU-second")
        out.append(target(SECTION, "the same per CPU-second (low-noise view)", v, ">=", 0.97, 3))
    return out


def state_rows(sh: Dict[str, Any]) -> List[List[str]]:
    st, r = sh["state"], sh["ratios"]
    out: List[List[str]] = []
    for w, goal in (("2", 0.9), ("3", None)):
        v = r.get(f"save throughput per rank, sharded / raw fsync write ({w} workers)")
        out.append(
            target(SECTION, f"sharded save throughput per rank / raw fsync'd write of the same bytes, {w} workers", v, ">=", goal)
        )
    mem, grows = st["memory"], st["memory_vs_ranks"]
    peaks = "; ".join(
        f"{w}: {f(_med(mem.get(w), 'gathered', 'rank0_peak_above_rss_MB'), 0)} / {f(_med(mem.get(w), 'sharded', 'rank0_peak_above_rss_MB'), 0)}"
        for w in ("2", "3")
    )
    ok = grows.get("sharded rank0 peak does not grow with the ranks")
    out.append(
        [
            SECTION,
            "rank 0's peak memory during a save, MB above its RSS, gathered / sharded, by workers",
            peaks,
            "sharded does not grow with the ranks",
            "not measured" if ok is None else "**met**" if ok else "**missed**",
        ]
    )
    mode = "cold" if any("cold_s" in e for e in st["restore"].values()) else "warm"
    out.append(
        reported(
            SECTION,
            f"restore of a checkpoint saved on 2 workers, time on 1; on 3 / on 2 ({mode})",
            "; ".join(f(r.get(f"restore time, saved on 2 loaded on {w} / on 2 ({mode})")) for w in ("1", "3")),
        )
    )
    return out


def section(sh: Optional[Dict[str, Any]], in_suite: bool, fsdp: Optional[Dict[str, Any]] = None) -> List[str]:
    """## 9. Sharded state (FSDP2)."""
    hot = hot_of(sh, fsdp)
    lines = state_section(sh, in_suite) if sh else [f"## {SECTION}. Sharded state (FSDP2)", ""]
    if hot:
        lines += hot_section(hot, (fsdp or {}).get("command") if fsdp and fsdp.get("hot_loop") else None)
    return lines


def state_section(sh: Dict[str, Any], in_suite: bool) -> List[str]:
    st = sh["state"]
    s = st["state"]
    fl = sh.get("foreign_load") or {}
    when = (
        ""
        if in_suite
        else f" (run alone at {sh.get('started', '?')}, commit {(sh.get('git') or {}).get('commit', '?')}; not part of the suite run above)"
    )
    lines = [
        f"## {SECTION}. Sharded state (FSDP2)",
        "",
        f"`{sh['command']}`{when}. The state: {s['blocks']} Linear layers of {s['width']} x {s['width']} under FSDP2"
        f" (`fully_shard` on each and on the model) and AdamW after one step, {s['state_MB (parameters + AdamW)']} MB in all;"
        f" groups of 1, 2 and 3 worker processes on Gloo (forked from one forkserver that imported torch and the library once),"
        f" through the real `CheckpointManager` and `TorchDistComm`; {sh['rounds']} round(s) of 5 groups in a rotated order,"
        f" {sh['pairs_per_group']} save/raw pairs and {sh['restores_per_group']} restores per group; page cache {sh['page_cache']}."
        f" Other tenants used a median {100 * ((fl.get('state groups') or {}).get('median') or 0):.0f}% of the machine during"
        " the groups (max"
        f" {100 * ((fl.get('state groups') or {}).get('max') or 0):.0f}%).",
        "",
        "Save throughput: a synchronous sharded save (every rank writes, fsyncs and reads back its own file; rank 0 commits)"
        " against every rank writing a file of its rank file's size with one fsync, at the same time; alternated, each after"
        " the previous one's files were removed; a sample's time is its slowest rank's.",
        "",
    ]
    lines += table(
        ["workers", "rank file (MB)", "sharded save (s)", "raw write (s)", "MB/s per rank, sharded", "raw", "sharded / raw"],
        [
            [
                w,
                "/".join(f(b / 1e6, 0) for b in t["rank_file_bytes"]),
                f(t["sharded_save_s"]["median"], 3),
                f(t["raw_fsync_write_s"]["median"], 3),
                f(t["sharded_save_MB_per_s_per_rank"], 0),
                f(t["raw_fsync_write_MB_per_s_per_rank"], 0),
                f(t["sharded/raw throughput"]),
            ]
            for w, t in st["throughput"].items()
        ],
    )
    lines += [
        "Rank 0's peak memory during one save, the first thing a fresh group does after its step: `gathered` ="
        " `get_model_state_dict`/`get_optimizer_state_dict` (full_state_dict, cpu_offload) on every rank, then rank 0 saves the"
        f" whole state (replicated format), what the library did before sharded checkpoints; `sharded` = the save above"
        f" (`save (s)`: that save's time, a process's first). {sh.get('memory_measure', '')}.",
        "",
    ]
    body = []
    for w, m in st["memory"].items():
        for method in ("gathered", "sharded"):
            e = m.get(method)
            if e:
                body.append(
                    [
                        w,
                        method,
                        f(e["rank0_peak_above_rss_MB"]["median"], 1),
                        ", ".join(f(x, 1) for x in e["every_rank_peak_above_rss_MB (median)"]),
                        f(e["rank0_rss_before_MB"], 0),
                        f(e["save_s"]["median"], 2),
                        f(e["checkpoint_bytes"] / 1e6, 0),
                    ]
                )
    lines += table(
        [
            "workers",
            "save",
            "rank 0 peak above RSS (MB)",
            "every rank's (MB)",
            "rank 0 RSS before (MB)",
            "save (s)",
            "checkpoint (MB)",
        ],
        body,
    )
    lines += [
        "Restore of the checkpoint saved by 2 workers into a fresh FSDP2 model and AdamW (no optimizer state yet) of each"
        " world size, through `CheckpointManager.restore`; every restored state checked against the saved one. MB read per"
        " rank: /proc/self/io rchar during a warm restore (each file is also verified whole, by one rank each).",
        "",
    ]
    lines += table(
        ["workers", "cold (s)", "/ 2 workers", "warm (s)", "/ 2 workers", "MB read per rank (warm)", "verified"],
        [
            [
                w,
                f(_med(e, "cold_s"), 3),
                f(e.get("/2 workers (cold)")),
                f(_med(e, "warm_s"), 3),
                f(e.get("/2 workers (warm)")),
                ", ".join(f(x, 0) for x in e.get("warm_rchar_MB_per_rank", [])),
                "yes" if e.get("verified") else "no",
            ]
            for w, e in sorted(st["restore"].items())
        ],
    )
    return lines


def hot_section(hot: Dict[str, Any], command: Optional[str]) -> List[str]:
    j = hot["job"]
    paired = hot.get("ours/baseline steps_per_s, paired rounds") or {}
    lines = [
        (f"`{command}`: " if command else "")
        + f"FSDP2 hot loop: `python -m pipeline.train {' '.join(o for o in hot['overrides'] if o.startswith(('parallel', 'trainer.optimizer')))}`"
        f" vs `bench/baseline_fsdp.py` (fully_shard on every Linear and the model, AdamW, batches sliced from the tensors)"
        f" under torchrun, 2 workers, MLP {j['hidden']}, batch {j['batch_size']} per worker, {j['steps_per_epoch']} steps;"
        f" {hot['rounds']} alternated rounds; steps/s: the median 10-step interval after {hot['warmup_steps']} warm-up steps."
        f" Snapshot interval ours settled on (auto): {hot.get('ours_snapshot_every_n_steps')}."
        + (
            " Each round's ours / baseline (the two runs back to back): "
            + ", ".join(f(x, 3) for x in paired.get("samples", []))
            + f"; median {f(paired.get('median'), 3)}."
            if paired.get("n")
            else ""
        ),
        "",
    ]
    lines += table(
        [
            *SPEED_COLUMNS,
            "other tenants' share",
            "time to first step (s)",
        ],
        [
            [
                k,
                *spread(v, 1),
                f(hot["cpu_ms_per_step"][k]["median"], 1),
                f((hot["foreign_load"].get(k) or {}).get("median")),
                f(hot["ttfs_s"][k]["median"]),
            ]
            for k, v in hot["steps_per_s (median interval)"].items()
        ],
    )
    return lines
