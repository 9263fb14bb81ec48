"""BENCHMARKS.md's rows and section 5, checkpoint throughput (bench.checkpoint_io); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table, target


def rows(ck: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if ck:
        for case in ck.get("results", []):
            rr = case["ratios"]
            tag = case["case"].split(":")[0]
            goal = 0.9 if tag == "A" else 0.8  # B and C, states of many small tensors: 0.8 (issue 25)
            rows.append(
                target(
                    "5",
                    f"checkpoint {tag}: project sync save / raw fsync write, throughput",
                    rr.get("project_sync/raw_fsync_write throughput"),
                    ">=",
                    goal,
                )
            )
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
            f"`{ck['command']}` ({ck.get('reads', '')}); medians of {ck['results'][0]['repeats']} rotated repeats.",
            "",
        ]
        for case in ck["results"]:
            lines += [f"{case['case']} ({case['payload_bytes'] / 2**20:.1f} MiB):", ""]
            lines += table(
                ["method", "median s", "MiB/s"],
                [[k, f(v["median_s"], 4), f(v["MiB_per_s"], 0)] for k, v in case["methods"].items()],
            )
    return lines
