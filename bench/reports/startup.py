"""BENCHMARKS.md's rows and section 2, time to first step (bench.startup); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, foreign_note, reported, spread, table, target


def rows(st: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if st:
        v = st["ratios"].get("ours/baseline ttfs")
        rows.append(
            target(
                "2",
                "time to first step, ours (default: forkserver) / torchrun + hand-written script",
                v,
                "<=",
                1.10,
                goal_text="<= 1.10",
            )
        )
        for k, label in (
            ("ours_spawn", "`backend.start_method=spawn`"),
            ("ours_fork", "`backend.start_method=fork` (not safe: the launcher has threads)"),
        ):
            if f"{k}/baseline ttfs" in st["ratios"]:
                v2 = st["ratios"][f"{k}/baseline ttfs"]
                rows.append(reported("2", f"the same with {label}", f(v2, 2)))
    return rows


def section(st: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if st:
        lines += [
            "## 2. Time to first step",
            "",
            f"From just before the command's process is created to the end of the first training step, tiny job"
            f" ({st['job']['parameter_MB']} MB MLP, synthetic data), 2 workers, {st['rounds']} alternated rounds."
            + foreign_note(*(st.get("foreign_load") or {}).values()),
            "",
        ]
        lines += table(
            ["command", "time to first step (s), median", "min", "max", "/ baseline"],
            [
                [
                    k,
                    *spread(v, 2),
                    f(st["ratios"].get(f"{k}/baseline ttfs"), 2) if k != "baseline" else "1",
                ]
                for k, v in st["ttfs_s"].items()
            ],
        )
        lines += [
            "`ours`: the default, `backend.start_method=forkserver` (workers fork from a server that imported torch, DDP's imports"
            " and the library once, in parallel with the launcher's own start-up); `ours_spawn`: every worker a new interpreter"
            " that imports torch; `ours_fork`: copies of the launcher (fast, not safe: the launcher has threads).",
            "",
        ]
        b = st.get("breakdown")
        if b and "baseline" in b:
            variants = [k for k in ("ours_spawn", "ours_fork") if k in b]
            lines += [
                "Where the time goes (traced runs: `bench/trace/sitecustomize.py`, enabled only for these runs through"
                " `PYTHONPATH` and `STEADFAST_BENCH_TRACE`; no project code changed). Each row ends at a milestone on the"
                " critical path (the later worker for worker rows); forked workers import nothing, so their import rows are 0.",
                "",
            ]
            labels = list(b["ours"]["segments_s"])
            rows = [
                [
                    lab,
                    f(b["baseline"]["segments_s"][lab], 3),
                    f(b["ours"]["segments_s"][lab], 3),
                    f(b["extra_s"][lab], 3),
                    *[f(b[v]["segments_s"][lab], 3) for v in variants],
                ]
                for lab in labels
            ]
            rows.append(
                [
                    "**time to first step (traced)**",
                    f(b["baseline"]["ttfs_s"], 3),
                    f(b["ours"]["ttfs_s"], 3),
                    f(b["ours"]["ttfs_s"] - b["baseline"]["ttfs_s"], 3),
                    *[f(b[v]["ttfs_s"], 3) for v in variants],
                ]
            )
            lines += table(["segment (s, median)", "baseline", "ours", "extra", *variants], rows)
            d = b["ours"]["details"]
            lines += [
                f"Inside: Hydra composes the config {f(d['hydra_compose_calls'], 0)} times ({f(d['hydra_compose_s'], 3)} s in all),"
                f" plugin discovery {f(d['plugin_scan_s'], 3)} s, pre-flight checks {f(d['preflight_s'], 3)} s, torch import in the"
                f" launcher {f(d['launcher_torch_import_s'], 2)} s, in the slower worker Hydra {f(d['worker_hydra_import_s (slowest)'], 3)} s"
                f" and torch {f(d['worker_torch_import_s (slowest)'], 2)} s, DDP construction {f(d['ddp_init_s (slowest)'], 2)} s"
                f" (it imports torch._dynamo, for the baseline too), checkpoint discovery {f(d['checkpoint_discovery_s (slowest)'], 3)} s."
                f" The forkserver's imports took {f(d.get('forkserver_preload_s'), 2)} s (in parallel with the launcher)."
                f" The job payload every worker reads from its private file is {f(d.get('payload_bytes'), 0)} bytes; the two"
                f" workers were created {f(d.get('workers_created_apart_s'), 2)} s apart.",
                "",
            ]
    return lines
