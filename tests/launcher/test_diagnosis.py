"""The first failure named right, end to end: a chosen rank of 2 torchrun workers is killed (SIGKILL),
crashes (SIGSEGV) or raises; its peer then fails too (its collective finds the connection gone), and
torch elastic reports whichever of the two its polling finds first. Each time the events, the
console, train.log, the final message, summary.json and the report name the chosen rank and its
cause first, the peer only as a consequence; the console gets one line for the failure and no
traceback. (A hung rank: tests/launcher/test_hang_and_report.py; a slow one: tests/telemetry/test_stragglers.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import QUICK, events, run_dir, run_train, summary

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "fault, rank, how",
    [("kill_rank", 1, "killed by SIGKILL"), ("segfault", 0, "killed by SIGSEGV"), ("exception", 1, "raised InjectedFault")],
)
def test_the_failed_rank_and_its_cause_are_named_first_everywhere(
    tmp_path: Path, fault: str, rank: int, how: str, capsys: pytest.CaptureFixture
) -> None:
    peer = 1 - rank
    proc = run_train(
        tmp_path, *QUICK, f"fault={fault}", f"fault.rank={rank}", "fault.at_step=20", "restart.max_restarts=0", "run.name=r"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    folder = run_dir(tmp_path, "r")
    named = f"rank {rank} (pid "

    failed = [e for e in events(folder) if e["event"] == "attempt_failed"]
    assert len(failed) == 1, failed
    cause = failed[0]
    assert cause["rank"] == rank and cause["how"].startswith(how) and cause["step"] == 20, cause
    assert [c["rank"] for c in cause["consequences"]] == [peer], cause
    fired = next(e for e in events(folder) if e["event"] == "fault_fired")
    assert cause["worker_pid"] == fired["pid"], "the rank named is the process the fault ended"
    if fault != "exception":
        assert cause["signal"] == how.split()[-1] and "error" not in cause
    if fault == "segfault":
        assert "steadfast/faults.py" in cause["where"], "the crash site, from the stack faulthandler wrote"

    console = proc.stdout + proc.stderr
    lines = [line for line in console.splitlines() if named in line and how in line]
    assert lines and lines[0].split(" - ", 1)[-1].startswith(named), console[-3000:]
    assert "no restarts left" in lines[0]
    assert "Traceback" not in console and "ProcessExitedException" not in console, console[-3000:]
    assert f"Cause: {named}" in proc.stderr

    log = (folder / "train.log").read_text()
    assert f"WARNING] - {named}" in log and how in log
    assert f"consequence: rank {peer} " in log

    s = summary(folder)
    assert s["status"] == "failed" and s["failures"][0].startswith(named) and how in s["failures"][0]

    from steadfast.report import main

    assert main([str(folder), "--no-plot"]) == 0
    report = capsys.readouterr().out
    attempts = report.split("how it ended", 1)[1].splitlines()[1]
    assert named in attempts and how in attempts, report
