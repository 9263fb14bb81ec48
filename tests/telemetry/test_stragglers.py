"""A slowed rank is named: fault=slow_rank on rank 1 of 2 torchrun workers, through the event, rank 0's
progress line (console and log) and the report; rank 0 never."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from helpers import QUICK, events, run_dir, run_train

EVERY = 4  # steps per logging window
WINDOWS = 3  # logger.straggler_windows (its default)


def test_a_slowed_rank_is_named_within_a_few_windows_and_rank_0_never(tmp_path: Path) -> None:
    proc = run_train(
        tmp_path,
        *QUICK,
        "trainer.max_epochs=2",  # 26 steps
        f"trainer.log_every_n_steps={EVERY}",
        "logger.progress=lines",
        "logger.progress_every_s=0.1",
        "fault=slow_rank",
        "fault.rank=1",
        "fault.at_step=1",
        "fault.delay_s=0.02",
        "run.name=r",
        timeout=120,
        check=True,
    )
    folder = run_dir(tmp_path, "r")
    named = [e for e in events(folder) if e["event"] == "straggler"]
    assert [(e["rank"], e["recovered"]) for e in named] == [(1, False)], named  # once, not every window
    (e,) = named
    # slowed from step 1: its third window in a row ends at step 12, read one window later
    assert e["step"] <= EVERY * (WINDOWS + 1) and e["windows"] == WINDOWS, e
    assert e["local_ms"] >= 20 and e["ratio"] > 1.25 and e["host"] == socket.gethostname(), e
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    local = [r["local_ms_per_rank"] for r in rows if "local_ms_per_rank" in r]
    # rank 1 carries the 20 ms it slept in every window; rank 0's own time is whatever the machine gave it
    assert local and all(slow >= 20 for _, slow in local), local
    for where, out in (("console", proc.stderr), ("rank0.log", (folder / "logs" / "rank0.log").read_text())):
        assert "| slow: rank 1 (+" in out and "straggler: rank 1:" in out, where
        assert "slow: rank 0" not in out and "straggler: rank 0" not in out, where
    from steadfast.report import analyse, format_run, load_run

    report = format_run(analyse(load_run(folder)))
    assert f"straggler: rank 1 on {socket.gethostname()} slower than the others from step {e['step']}" in report, report
    assert "straggler: rank 0" not in report and "fault fired: slow_rank on rank 1" in report, report
