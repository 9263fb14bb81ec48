"""BENCHMARKS.md's rows and section 12, checkpoints in an object store (bench.checkpoint_s3)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, reported, table

SECTION = "12"


def rows(s3: Optional[Dict[str, Any]]) -> List[List[str]]:
    if not s3 or s3.get("skipped"):
        return []
    r = s3["ratios"]
    return [
        reported(
            SECTION,
            "object store (local SeaweedFS): project sync save / raw put_object of the same bytes, throughput",
            f(r.get("project_sync/raw_put throughput"), 2),
        ),
        reported(
            SECTION,
            "the same, save + read-back and retention (wait()) / raw put_object",
            f(r.get("project_checked/raw_put throughput"), 2),
        ),
    ]


def section(s3: Optional[Dict[str, Any]]) -> List[str]:
    if not s3:
        return []
    lines = [f"## {SECTION}. Checkpoints in an object store", ""]
    if s3.get("skipped"):
        return lines + [f"Skipped: {s3['skipped']}.", ""]
    mib = s3["mib"]
    lines += [
        f"`{s3['command']}`: a checkpoint of {f(mib, 1)} MiB of float32 tensors saved to `s3://` on a local SeaweedFS"
        " server (scripts/s3_server.sh) through `CheckpointManager`, against boto3's put_object of the same bytes as one"
        f" object (the file made beforehand), alternated in a rotated order, medians of {s3.get('repeats', '?')}."
        " `project_sync`: the file put, the manifest put last (committed); `project_checked`: also its read-back and"
        " retention; `restore`: list, read the manifest, GET and verify every byte. The server runs on the same 2 cores"
        " as the client: compare the ratios, not the MiB/s.",
        "",
    ]
    lines += table(
        ["method", "median s", "MiB/s", "/ raw_put (throughput)"],
        [
            [k, f(v, 3), f(mib / v, 0) if v else "n/a", f(s3["median_s"]["raw_put"] / v, 2) if v else "n/a"]
            for k, v in s3["median_s"].items()
        ],
    )
    return lines
