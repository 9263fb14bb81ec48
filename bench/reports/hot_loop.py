"""BENCHMARKS.md's rows and section 1, the hot loop (bench.hot_loop); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import SPEED_COLUMNS, f, foreign_note, reported, spread, table, target


def rows(hot: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if hot:
        r = hot["ratios"]
        for key, label, goal in (
            ("ours/baseline", "hand-written DDP with a DataLoader", 0.99),
            ("ours/baseline_slices", "minimal hand-written DDP loop (batches sliced from the tensors)", 0.97),
        ):
            v = r.get(f"{key} steps_per_s")
            if v is not None:
                rows.append(target("1", f"hot loop: steps/s, ours / {label} (wall clock)", v, ">=", goal, 3))
                v = r.get(f"{key} steps per CPU-second (workers + launcher)")
                rows.append(target("1", "the same per CPU-second (low-noise view, see section 1)", v, ">=", goal, 3))
        for key, val in r.items():
            if key.endswith("/baseline steps per CPU-second") and not key.startswith("ours/"):
                overrides = (hot.get("variants") or {}).get(key.split("/")[0], {}).get("overrides", [])
                rows.append(reported("1", f"the same with `{' '.join(overrides)}`", f(val, 3)))
        every = hot.get("checkpoint_every_n_steps")
        for kind in ("sync", "async"):
            key = f"{kind} ckpt every {every} steps / no ckpt steps_per_s"
            if key in r:
                rows.append(
                    reported(
                        "1",
                        f"speed with a {kind} checkpoint every {every} steps / without: within runs; across runs; per CPU-second",
                        f"{f(r[key], 3)}; {f(r.get(key + ' (across runs)'), 3)}; {f(r.get(f'{kind} ckpt every {every} steps / no ckpt steps per CPU-second'), 3)}",
                    )
                )
        if hot.get("projected"):
            pj = hot["projected"]
            rows.append(
                reported(
                    "1",
                    f"the same at the default cadence (every 10 epochs = {pj['default_cadence_steps']} steps), sync / async (projected from the per-save cost)",
                    f"{f(pj['sync ckpt every 10 epochs / no ckpt steps_per_s'], 4)} / {f(pj['async ckpt every 10 epochs / no ckpt steps_per_s'], 4)}",
                )
            )
    return rows


def section(hot: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if hot:
        lines += [
            "## 1. Hot loop",
            "",
            f"`python -m pipeline.train` vs `bench/baseline_ddp.py` under `torchrun --standalone --nproc_per_node {hot['job']['workers']}`,"
            f" same model (MLP {hot['job']['hidden']}, {hot['job']['parameter_MB']} MB), data (synthetic, {hot['job']['num_features']} features),"
            f" batch {hot['job']['batch_size']} per worker, {hot['job']['epochs']} epoch(s) of {hot['job']['steps_per_epoch']} steps; {hot['rounds']} alternated rounds"
            f" ({hot.get('checkpoint_rounds', 0)} with the checkpoint variants). Steps/s: the median logged 10-step interval after"
            f" {hot['warmup_steps']} warm-up steps, intervals spanning an epoch end (the trainer validates there) or a checkpoint left out."
            + foreign_note(*(hot.get("foreign_load") or {}).values()),
            "",
        ]
        sp = hot["steps_per_s (median interval)"]
        cpu = hot.get("cpu_s_per_step", {})

        def ms(k: str, field: str) -> str:
            x = (cpu.get(k, {}).get(field) or {}).get("median")
            return f(x * 1e3 if x is not None else None, 2)

        lines += table(
            [
                *SPEED_COLUMNS,
                "launcher's share of a core",
                "other tenants' share of the machine",
                "time to first step (s)",
            ],
            [
                [
                    k,
                    *spread(v, 1),
                    ms(k, "total_cpu_s_per_step"),
                    f((cpu.get(k, {}).get("launcher_cpu_share") or {}).get("median"), 3),
                    f((hot.get("foreign_load", {}).get(k) or {}).get("median"), 2),
                    f(hot["ttfs_s"][k]["median"], 2),
                ]
                for k, v in sp.items()
            ],
        )
        lines += [
            "CPU ms per step: user + system CPU time of every process of the run (workers, and the launcher or torchrun)"
            " over the measured window, read from /proc every 0.2 s. Wall-clock speed moves with other tenants' load"
            " (see the min..max); CPU time per step hardly does, so its ratio is the better estimate of what the"
            " framework adds to each step. Variants: "
            + ", ".join(
                f"`{k}` = `{' '.join(v['overrides'])}`" + (" (failed: left out)" if v.get("failed") else "")
                for k, v in (hot.get("variants") or {}).items()
            )
            + ".",
            "",
        ]
        if hot.get("checkpoint_costs"):
            c = hot["checkpoint_costs"]
            lines += [
                f"Checkpoint cost per save ({hot['checkpoint_every_n_steps']}-step cadence): sync {f(c['sync_save_seconds'], 4)} s blocking;"
                f" async {f(c['async_blocked_seconds'], 4)} s blocking (snapshot) and {f(c['async_save_to_commit_seconds'], 4)} s to commit in the background."
                " The slowdowns above compare, within each run, the mean speed over all intervals with the median interval (so a"
                " run-to-run speed difference cancels), against the same ratio of the runs without checkpoints.",
                "",
            ]
    return lines
