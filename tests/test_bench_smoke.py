"""The benchmark scripts still run (on a tiny size); their timings are not checked here."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, env


def test_checkpoint_io_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "bench.checkpoint_io", "--mb", "4", "--tensors", "4", "--repeats", "1",
           "--no-drop-caches", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["command"].endswith("--json " + str(out))
    assert {"cpu_count", "platform", "torch"} <= set(result["machine"])
    big, model = result["results"]
    assert big["payload_bytes"] == 4 << 20
    assert 0 < model["payload_bytes"] < 1 << 20
    methods = {"project_sync", "async_blocked", "async_total", "torch_save", "raw_fsync_write", "restore_warm", "raw_read_warm"}
    ratios = {"project_sync/raw_fsync_write throughput", "torch_save/raw_fsync_write throughput",
              "async_blocked/sync_save time", "restore/raw_read throughput (warm)"}
    for r in (big, model):
        assert set(r["methods"]) == methods
        assert all(len(m["samples_s"]) == 1 and m["median_s"] > 0 for m in r["methods"].values())
        assert ratios <= set(r["ratios"]) and all(v > 0 and math.isfinite(v) for v in r["ratios"].values())
    for name in ratios:
        assert name in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # written files are cleaned up
