"""The report's analysis on records built by hand (no processes): attempts, where each resumed from,
the steps each lost, the time breakdown and goodput; and the reading of a run folder whose files are
missing, damaged or hostile (a report that says what is wrong, never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from helpers import env
from steadfast.contract.events import Event
from steadfast.report import analysis, loader, text
from steadfast.report.model import Outcome, RunReport
from steadfast.report.records import RunRecords, Summary, metric_rows

STEP_S = 0.1  # every hand-made attempt trains at 0.1 s a step


class Records:
    """A run's events and metric rows, written in time order; each attempt logs every 10 steps."""

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []
        self.rows: List[Dict[str, Any]] = []

    def ev(self, t: float, kind: Event, **fields: Any) -> "Records":
        self.events.append({"time": t, "event": kind.value, "host": "h", "pid": 1, **fields})
        return self

    def train(self, t0: float, first: int, last: int, restart: int) -> "Records":
        """Logged steps first..last (every 10) starting at t0, and the attempt's first_step record."""
        self.ev(t0, Event.FIRST_STEP, restart=restart, step=first)
        self.rows += [
            dict(time=t0 + STEP_S * (s - first), step=s, loss=2.0 - s / 1000, restart=restart) for s in range(first, last + 1, 10)
        ]
        return self

    def records(self, folder: Path = Path("run"), summary: Optional[Summary] = None) -> RunRecords:
        return RunRecords(folder=folder, events=self.events, metrics=metric_rows(self.rows)[0], summary=summary or Summary())

    def report(self, **kw: Any) -> RunReport:
        return analysis.analyse(self.records(**kw), relative_to="/work/app")


def crash_and_restart() -> Records:
    """Rank 1 SIGKILLed at step 250; torch elastic restarts the group from the checkpoint of step 200."""
    r = Records().ev(0, Event.LAUNCH).ev(5, Event.ATTEMPT_STARTED, restart=0).train(6, 10, 250, restart=0)
    r.ev(16, Event.CHECKPOINT_SAVED, restart=0, step=100, seconds=0.5).ev(
        26, Event.CHECKPOINT_SAVED, restart=0, step=200, seconds=0.5
    )
    r.ev(31, Event.FAULT_FIRED, restart=0, fault="kill", rank=1, step=250)
    r.ev(32, Event.ATTEMPT_ENDED, restart=0, last_step=250)
    r.ev(40, Event.ATTEMPT_STARTED, restart=1).ev(41, Event.RESUMED, restart=1, step=200).train(42, 210, 400, restart=1)
    r.ev(52, Event.CHECKPOINT_SAVED, restart=1, step=300, seconds=0.5).ev(
        62, Event.CHECKPOINT_SAVED, restart=1, step=400, seconds=0.5
    )
    r.ev(62, Event.TRAINING_COMPLETED, restart=1, step=400).ev(63, Event.ATTEMPT_ENDED, restart=1, last_step=400)
    return r.ev(64, Event.JOB_COMPLETED, relaunches=0)


def test_a_crash_and_restart_loses_the_steps_since_the_checkpoint() -> None:
    r = crash_and_restart().report(summary=Summary(status="completed", global_step=400))
    assert r.status == "completed" and len(r.launches) == 1 and r.restarts == 1 and r.preemptions == 0
    a0, a1 = r.attempts
    assert (a0.outcome, a0.cause, a0.resumed_from, a0.source, a0.last_step, a0.lost_steps) == (
        Outcome.FAILED,
        "fault=kill on rank 1 at step 250",
        0,
        None,
        250,
        50,
    )
    assert (a1.outcome, a1.resumed_from, a1.source, a1.last_step, a1.lost_steps) == (Outcome.COMPLETED, 200, "disk", 400, 0)
    assert (a0.start, a0.end, a1.start, a1.end) == (0, 32, 32, 63)  # attempt 1 starts when attempt 0 ended
    assert a0.step_time == pytest.approx(STEP_S) and a1.step_time == pytest.approx(STEP_S)
    b = r.breakdown
    assert b.wall == 64 and b.startup == pytest.approx(6 + 10) and b.checkpoint == pytest.approx(4 * 0.5)
    assert b.useful == pytest.approx(400 * STEP_S) and b.redone == pytest.approx(50 * STEP_S) and b.hung == 0
    assert b.other == pytest.approx(64 - 16 - 2 - 40 - 5)
    assert r.goodput == pytest.approx(40 / 64)
    assert [(f.fault, f.rank, f.step, f.restart) for f in r.faults] == [("kill", 1, 250, 0)]


def test_a_preemption_saves_and_the_next_launch_loses_nothing() -> None:
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 510, restart=0)
    r.ev(56, Event.PREEMPTED, restart=0, step=510, signal="SIGTERM", saved=True)
    r.ev(56.5, Event.CHECKPOINT_SAVED, restart=0, step=510, seconds=0.5).ev(57, Event.ATTEMPT_ENDED, restart=0, last_step=510)
    r.ev(58, Event.JOB_INTERRUPTED, attempt=0, signal="SIGTERM")
    r.ev(1000, Event.LAUNCH).ev(1004, Event.ATTEMPT_STARTED, restart=0).ev(1004.5, Event.RESUMED, restart=0, step=510)
    r.train(1005, 520, 800, restart=0).ev(1033, Event.TRAINING_COMPLETED, restart=0, step=800)
    r.ev(1034, Event.ATTEMPT_ENDED, restart=0, last_step=800).ev(1035, Event.JOB_COMPLETED, relaunches=0)
    rep = r.report()
    assert rep.status == "completed"  # no summary.json: from the last launch's end record
    assert [(x.start, x.end, x.ended_by) for x in rep.launches] == [
        (0, 58, Event.JOB_INTERRUPTED),
        (1000, 1035, Event.JOB_COMPLETED),
    ]
    assert rep.restarts == 0 and rep.preemptions == 1 and rep.breakdown.wall == 58 + 35
    a0, a1 = rep.attempts
    assert (a0.outcome, a0.cause, a0.lost_steps) == (Outcome.PREEMPTED, "preempted by SIGTERM at step 510 (saved)", 0)
    assert (a1.launch, a1.restart, a1.start, a1.resumed_from, a1.outcome) == (1, 0, 1000, 510, Outcome.COMPLETED)
    assert rep.breakdown.useful == pytest.approx(800 * STEP_S) and rep.breakdown.redone == 0


def test_a_preemption_that_did_not_save_in_time_says_so() -> None:
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 100, restart=0)
    r.ev(20, Event.PREEMPTION_GRACE_EXPIRED, signal="SIGTERM", grace_s=5).ev(21, Event.JOB_INTERRUPTED, signal="SIGTERM")
    (a,) = r.report().attempts
    assert (a.outcome, a.cause) == (Outcome.PREEMPTED, "preempted by SIGTERM: not saved within the grace period")


def test_a_hang_is_failed_at_its_step_and_its_time_until_detection_counted() -> None:
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 650, restart=0)
    r.ev(60, Event.CHECKPOINT_SAVED, restart=0, step=600, seconds=0.5)
    r.ev(
        74.8,
        Event.HANG_DETECTED,
        restart=0,
        rank=1,
        step=650,
        seconds_without_progress=4.8,
        where="/work/app/pipeline/faults.py:104 in _fire",
    )
    r.ev(75, Event.ATTEMPT_ENDED, restart=0, last_step=650)
    r.ev(80, Event.ATTEMPT_STARTED, restart=1).ev(81, Event.RESUMED, restart=1, step=600).train(82, 610, 800, restart=1)
    r.ev(101, Event.TRAINING_COMPLETED, restart=1, step=800).ev(102, Event.JOB_COMPLETED)
    rep = r.report()
    a0, a1 = rep.attempts
    assert (a0.outcome, a0.cause) == (Outcome.FAILED, "hang: rank 1 at step 650 (pipeline/faults.py:104 in _fire)")
    assert a0.hung == pytest.approx((70.0, 74.8)) and a0.end == 75 and a0.lost_steps == 50
    assert rep.breakdown.hung == pytest.approx(4.8) and rep.breakdown.redone == pytest.approx(50 * STEP_S)
    assert a1.outcome is Outcome.COMPLETED and a1.end == 101  # no attempt_ended: its training_completed record


def test_a_relaunch_by_the_launcher_names_the_cause_it_recorded() -> None:
    # Horovod: the launcher relaunches the job; the worker killed by the OOM killer recorded nothing
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 130, restart=0)
    r.ev(15, Event.CHECKPOINT_SAVED, restart=0, step=100, seconds=0.5).ev(20, Event.ATTEMPT_ENDED, restart=0, last_step=130)
    r.ev(21, Event.RELAUNCH, attempt=1, cause="rank 1 exited with -9 (SIGKILL)")
    r.ev(28, Event.ATTEMPT_STARTED, restart=1).ev(28.5, Event.RESUMED, restart=1, step=100).train(29, 110, 120, restart=1)
    r.ev(30, Event.WORKER_FAILED, restart=1, rank=0, error="RuntimeError: boom", where="x.py:1")
    r.ev(31, Event.ATTEMPT_ENDED, restart=1, last_step=120)
    r.ev(32, Event.RELAUNCH, attempt=2, cause="the relaunch's own wording")
    r.ev(38, Event.ATTEMPT_STARTED, restart=2).ev(38.5, Event.RESUMED, restart=2, step=100).train(39, 110, 300, restart=2)
    r.ev(59, Event.TRAINING_COMPLETED, restart=2, step=300).ev(60, Event.JOB_COMPLETED, relaunches=2)
    rep = r.report()
    assert rep.restarts == 2 and [a.restart for a in rep.attempts] == [0, 1, 2]
    a0, a1, a2 = rep.attempts
    assert (a0.outcome, a0.cause, a0.lost_steps) == (Outcome.FAILED, "rank 1 exited with -9 (SIGKILL)", 30)
    assert (a1.cause, a1.lost_steps) == ("rank 0: RuntimeError: boom", 20)  # the worker's own record comes first
    assert (a1.start, a2.start) == (20, 31) and a2.outcome is Outcome.COMPLETED


def test_a_stop_that_must_not_be_restarted() -> None:
    # trainer.max_rss_mb: the task saves, records memory_limit and the launcher job_stopped (no summary.json here)
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 1, 10, restart=0)
    r.ev(7, Event.MEMORY_LIMIT, restart=0, step=10, saved=True, rank=0, rss_mb=80)
    r.ev(8, Event.ATTEMPT_ENDED, restart=0, last_step=10).ev(9, Event.JOB_STOPPED, reason="memory_limit", step=10, message="m")
    rep = r.report()
    (a,) = rep.attempts
    assert (rep.status, a.outcome, a.cause, rep.preemptions) == (
        "memory_limit",
        Outcome.STOPPED,
        "memory limit at step 10 (saved)",
        0,
    )


def test_a_worker_that_died_without_a_record_and_the_launch_interrupted_after() -> None:
    # attempt 0 dies silently, attempt 1 is running when SIGTERM arrives: only attempt 1 was stopped by it
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 50, restart=0)
    r.ev(11, Event.ATTEMPT_ENDED, restart=0, last_step=50)
    r.ev(12, Event.ATTEMPT_STARTED, restart=1).train(13, 10, 40, restart=1).ev(20, Event.JOB_INTERRUPTED, signal="SIGTERM")
    a0, a1 = r.report().attempts
    assert (a0.outcome, a0.cause, a0.end) == (
        Outcome.FAILED,
        "a worker died without recording an error (killed by a signal?)",
        11,
    )
    assert (a1.outcome, a1.cause, a1.lost_steps, a0.lost_steps) == (Outcome.PREEMPTED, "stopped by SIGTERM", 0, 50)


def test_a_run_without_failures() -> None:
    r = Records().ev(0, Event.LAUNCH).ev(3, Event.ATTEMPT_STARTED, restart=0).train(4, 10, 520, restart=0)
    r.ev(20, Event.CHECKPOINT_SNAPSHOT, restart=0, step=200, blocked_seconds=0.05, pid=7)
    r.ev(21, Event.CHECKPOINT_SAVED, restart=0, step=200, seconds=1.5, pid=7)  # asynchronous: only the snapshot blocked
    r.ev(55.1, Event.TRAINING_COMPLETED, restart=0, step=520).ev(56, Event.ATTEMPT_ENDED, restart=0, last_step=520)
    rep = r.ev(57, Event.JOB_COMPLETED).report(summary=Summary(status="completed", global_step=520, val_loss=0.5))
    (a,) = rep.attempts
    assert (a.outcome, a.lost_steps, a.source, rep.restarts, rep.preemptions) == (Outcome.COMPLETED, 0, None, 0, 0)
    b = rep.breakdown
    assert b.useful == pytest.approx(520 * STEP_S) and b.checkpoint == pytest.approx(0.05) and b.startup == 4
    assert b.redone == b.hung == 0 and sum(b.part(k) for k in b.parts()) == pytest.approx(b.wall) == 57
    assert rep.goodput == pytest.approx(52 / 57)
    out = text.format_run(rep)
    assert "launches 1, attempts 1, restarts 0, preemptions 0, faults injected 0" in out
    assert "  wall 57.0 s: useful steps 52.0 s (goodput 91.2%), redone steps 0.0 s" in out
    assert "from" not in out.split("attempts:")[1].splitlines()[1]  # no memory restore: the table of today


def test_restores_from_memory_and_from_disk_are_told_apart() -> None:
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 230, restart=0)
    r.ev(27, Event.FAULT_FIRED, restart=0, fault="kill", rank=1, step=230).ev(28, Event.ATTEMPT_ENDED, restart=0, last_step=230)
    r.ev(30, Event.ATTEMPT_STARTED, restart=1).ev(30.5, Event.RESUMED, restart=1, step=225, source="memory")
    r.train(31, 230, 300, restart=1).ev(38, Event.FAULT_FIRED, restart=1, fault="exception", rank=0, step=300)
    r.ev(39, Event.ATTEMPT_ENDED, restart=1, last_step=300)
    r.ev(45, Event.ATTEMPT_STARTED, restart=2).ev(46, Event.RESUMED, restart=2, step=200, source="disk")
    r.train(47, 210, 400, restart=2).ev(66, Event.TRAINING_COMPLETED, restart=2, step=400).ev(67, Event.JOB_COMPLETED)
    rep = r.report()
    assert [(a.resumed_from, a.source, a.lost_steps) for a in rep.attempts] == [
        (0, None, 5),
        (225, "memory", 100),
        (200, "disk", 0),
    ]
    assert rep.resumed_from_memory
    out = text.format_run(rep)
    table = out.split("  attempts:\n")[1].splitlines()
    assert table[0].split() == ["#", "launch", "restart", "start", "resumed", "from", "reached", "lost", "how", "it", "ended"]
    assert [row.split()[4:8] for row in table[1:4]] == [
        ["0", "-", "230", "5"],
        ["225", "memory", "300", "100"],
        ["200", "disk", "400", "0"],
    ]
    assert "  restores: 1 from memory (5 step(s) lost before them), 1 from disk (100 step(s) lost before them)" in out


def test_a_launch_without_an_end_record_makes_the_summary_stale() -> None:
    # the first launch was preempted (its summary.json says so); the second one's launcher was SIGKILLed
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 100, restart=0)
    r.ev(16, Event.PREEMPTED, restart=0, step=100, signal="SIGTERM", saved=True).ev(17, Event.JOB_INTERRUPTED, signal="SIGTERM")
    r.ev(100, Event.LAUNCH).ev(104, Event.ATTEMPT_STARTED, restart=0).ev(105, Event.RESUMED, restart=0, step=100)
    r.train(106, 110, 200, restart=0)
    rep = r.report(summary=Summary(status="preempted", global_step=100))
    assert rep.status == analysis.NO_END_RECORDED
    assert (rep.attempts[-1].outcome, rep.attempts[-1].cause) == (Outcome.UNKNOWN, analysis.NO_END_RECORDED)
    assert rep.launches[-1].end == 106 and rep.attempts[-1].end == 106  # its last record


def test_records_of_the_wrong_types_are_ignored_not_fatal() -> None:
    events: List[Dict[str, Any]] = [
        {"time": 0, "event": Event.LAUNCH.value},
        {"time": "soon", "event": Event.ATTEMPT_STARTED.value, "restart": 0},
        {"time": 1, "event": "not_an_event", "restart": 0},
        {"time": 2, "event": Event.ATTEMPT_STARTED.value, "restart": "0"},
        {"time": 3, "event": Event.ATTEMPT_STARTED.value, "restart": 0},
        {"time": 4, "event": Event.RESUMED.value, "restart": 0, "step": "ten", "source": 5},
        {"time": 5, "event": Event.CHECKPOINT_SAVED.value, "restart": 0, "step": None, "seconds": "slow"},
        {"time": 6, "event": Event.HANG_DETECTED.value, "restart": 0, "rank": [1], "seconds_without_progress": {}},
        {"time": 7, "event": Event.JOB_FAILED.value, "error": 12},
    ]
    rows, unusable = metric_rows([{"time": 1, "step": "x"}, {"time": True, "step": 1}, {"time": 2.0, "step": 3.0, "loss": "low"}])
    assert unusable == 2 and rows[0].step == 3 and rows[0].loss is None
    rep = analysis.analyse(RunRecords(folder=Path("r"), events=events, metrics=rows))
    (a,) = rep.attempts
    assert (a.start, a.resumed_from, a.source, a.outcome, a.hung) == (0, 0, "disk", Outcome.FAILED, (6.0, 6.0))
    assert rep.status == "failed" and "problem" not in text.format_run(rep)


# ---- run folders on disk: the loader ------------------------------------------------------------
def write_run(folder: Path, r: Records, summary: Optional[Dict[str, Any]] = None, config: Optional[str] = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in r.events))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in r.rows))
    (folder / "summary.json").write_text(json.dumps(summary or {"status": "completed", "global_step": 400, "val_loss": 0.6}))
    if config is not None:
        (folder / "config.yaml").write_text(config)
    return folder


def commit_checkpoints(folder: Path, steps: List[int]) -> None:
    """Real committed checkpoints, written by the checkpoint manager itself."""
    from steadfast.checkpoint.manager import CheckpointManager
    from steadfast.distributed.comm import Comm

    class Box:
        def __init__(self, step: int) -> None:
            self.state = {"step": step}

        def state_dict(self) -> dict:
            return self.state

        def load_state_dict(self, state: dict) -> None:
            self.state = state

    manager = CheckpointManager(folder, Comm(), len(steps), {"a": 1}, lambda *a, **k: None)
    for step in steps:
        manager.save(step, {"model": Box(step)}, {"rng": Box(step)}, {"epoch": 0})
    manager.close()


def test_the_checkpoints_are_verified_where_the_runs_config_put_them(tmp_path: Path) -> None:
    custom = tmp_path / "elsewhere" / "ckpts"
    folder = write_run(
        tmp_path / "run", crash_and_restart(), config=f"run:\n  name: run\ncheckpoint:\n  dir: {custom}\n  keep_last: 3\n"
    )
    commit_checkpoints(custom, [200, 300, 400])
    commit_checkpoints(folder / "checkpoints", [7])  # not this run's folder any more: never looked at
    damaged = next(custom.glob("step_*300/state.bin"))
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 0xFF]))
    records = loader.load_run(folder)
    assert records.checkpoint_dir == str(custom) and records.problems == []
    assert [(c.step, c.verified) for c in records.checkpoints] == [(400, True), (300, False), (200, True)]
    out = text.format_run(analysis.analyse(records))
    assert (
        f"checkpoints: 4 committed during the run, 3 kept on disk in {custom}, 2 verified against their manifests, newest step 400"
        in out
    )
    assert "    step 300: DAMAGED: " in out and "checksum mismatch" in out
    # no checkpoint.dir: <run folder>/checkpoints, and the line of today (no folder named)
    (folder / "config.yaml").write_text("checkpoint:\n  dir: null\n")
    out = text.format_run(analysis.analyse(loader.load_run(folder)))
    assert "checkpoints: 4 committed during the run, 1 kept on disk, 1 verified against their manifests, newest step 7" in out


HOSTILE = {
    "events.jsonl": [
        b'\x00\xff garbage\n{"time": 1, "event": "launch"}\n[1, 2]\n',
        "2 line(s) that are not an event of this version",
    ],
    "metrics.jsonl": [b'{"time": 1, "step": 1, "loss": 1.0}\n{"cut by a cra', "1 line(s) that are not a JSON object"],
    "summary.json": [b"[1, 2, 3]", "summary.json: empty, or not a JSON object"],
    "config.yaml": [b"checkpoint: {dir: [unclosed\n", "config.yaml: not valid YAML"],
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_damaged_file_is_named_in_the_report_never_a_traceback(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    from steadfast.report import main

    folder = write_run(tmp_path / "run", crash_and_restart(), config="checkpoint:\n  dir: null\n")
    content, said = HOSTILE[name]
    (folder / name).write_bytes(content)
    assert main([str(folder), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert f"  problem: {name}: " in out and said in out, out
    assert out.count("  problem: ") == 1


def test_missing_unreadable_and_wrongly_typed_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from steadfast.report import main

    folder = write_run(
        tmp_path / "run", crash_and_restart(), summary={"status": "completed", "global_step": [400], "val_loss": "low"}
    )
    (folder / "metrics.jsonl").unlink()
    os.mkfifo(folder / "config.yaml")  # a FIFO would block a plain open(): never opened for reading
    (folder / "events.jsonl").unlink()
    (folder / "events.jsonl").mkdir()
    assert main([str(folder), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "problem: events.jsonl: not a regular file: no launches or attempts to show" in out
    assert "problem: metrics.jsonl: missing: no loss curve, no time per step" in out
    assert "problem: summary.json: unusable value(s) of global_step, val_loss, not shown" in out
    assert "problem: config.yaml: not a regular file: verified the default checkpoint folder" in out
    assert out.splitlines()[0].endswith(": completed") and "steps -, train loss (last epoch) -, val loss -" in out


def test_a_yaml_config_is_never_evaluated(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from steadfast.report import main

    marker = tmp_path / "evaluated"
    config = f"checkpoint: !!python/object/apply:os.system ['touch {marker}']\n"
    folder = write_run(tmp_path / "run", crash_and_restart(), config=config)
    assert main([str(folder), "--no-plot"]) == 0
    assert not marker.exists() and "problem: config.yaml: not valid YAML" in capsys.readouterr().out


def test_a_sweep_folder_lists_its_runs_and_compares_them(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    write_run(sweep / "lr=0.1", crash_and_restart())
    quiet = Records().ev(0, Event.LAUNCH).ev(3, Event.ATTEMPT_STARTED, restart=0).train(4, 10, 400, restart=0)
    write_run(
        sweep / "lr=0.01",
        quiet.ev(44, Event.TRAINING_COMPLETED, restart=0, step=400).ev(45, Event.JOB_COMPLETED),
        summary={"status": "completed", "global_step": 400, "val_loss": 0.5},
    )
    (sweep / "lr=0.01" / ".hydra").mkdir()
    (sweep / "lr=0.01" / ".hydra" / "summary.json").write_text("{}")  # hidden folders are not runs
    (sweep / "multirun.yaml").write_text("{}")
    assert not loader.is_run(sweep) and loader.find_runs(sweep) == [sweep / "lr=0.01", sweep / "lr=0.1"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.report", str(sweep)], env=env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert table[0] == f"Sweep {sweep}: 2 job(s)"
    assert table[2].split() == ["lr=0.01", "completed", "400", "0.5000", "0", f"{100 * 40 / 45:.0f}%", "45.0", "s"]
    assert table[3].split()[:5] == ["lr=0.1", "completed", "400", "0.6000", "1"]
    assert (sweep / "report.png").stat().st_size > 20_000 and "comparison picture:" in proc.stdout


def test_not_a_run_folder(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "steadfast.report", str(tmp_path)], env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "neither a run folder" in proc.stderr and "Traceback" not in proc.stderr


def test_a_relative_checkpoint_dir_is_looked_up_from_where_the_run_was_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_run(tmp_path / "launched_here" / "outputs" / "run", crash_and_restart(), config="checkpoint:\n  dir: ck/run\n")
    commit_checkpoints(tmp_path / "launched_here" / "ck" / "run", [400])
    monkeypatch.chdir(tmp_path / "launched_here")
    records = loader.load_run(Path("outputs/run"))
    assert records.checkpoint_dir == "ck/run" and [c.step for c in records.checkpoints] == [400] and not records.problems
    monkeypatch.chdir(tmp_path)
    records = loader.load_run(folder)
    assert records.checkpoints == [] and records.problems == [
        "checkpoint folder ck/run: not found from here (a relative checkpoint.dir is relative to the folder the run was "
        "launched from: run the report there)"
    ]


def test_the_steps_reached_are_the_furthest_any_record_shows() -> None:
    # the watchdog's view of a hung rank can lag (heartbeats are not every step); the fault and the
    # logged steps say how far the attempt really got
    r = Records().ev(0, Event.LAUNCH).ev(4, Event.ATTEMPT_STARTED, restart=0).train(5, 10, 30, restart=0)
    r.ev(6, Event.CHECKPOINT_SAVED, restart=0, step=13, seconds=0.1).ev(
        8, Event.FAULT_FIRED, restart=0, fault="hang", rank=1, step=40
    )
    r.ev(12, Event.HANG_DETECTED, restart=0, rank=1, step=14, seconds_without_progress=4.0, where="f.py:1")
    r.ev(12.5, Event.ATTEMPT_ENDED, restart=0, last_step=14)
    r.ev(20, Event.ATTEMPT_STARTED, restart=1).ev(21, Event.RESUMED, restart=1, step=13).train(22, 20, 52, restart=1)
    r.ev(26, Event.TRAINING_COMPLETED, restart=1, step=52).ev(27, Event.JOB_COMPLETED)
    a0, a1 = r.report().attempts
    assert (a0.last_step, a0.lost_steps, a0.cause) == (40, 27, "hang: rank 1 at step 14 (f.py:1)")
    r.events = [e for e in r.events if e["event"] != Event.FAULT_FIRED.value]
    assert r.report().attempts[0].last_step == 30  # the last logged step


def test_rollbacks_and_heals_are_in_the_text_and_their_steps_counted_as_redone(tmp_path: Path) -> None:
    """The anomaly guard's records (steadfast/health/): each finding a line; what a rollback gave up is
    redone time, not other; a record with fields of the wrong type still reads."""
    r = Records().ev(0, Event.LAUNCH).ev(5, Event.ATTEMPT_STARTED, restart=0).train(6, 10, 400, restart=0)
    r.ev(20, Event.ANOMALY, restart=0, anomaly="nonfinite_loss", step=120, ranks=[1, 0], agreed_at=130, action="rolled_back")
    r.events[-1].update(restored_step=100, source="memory", skipped=[0, 3840, 32, 119, 1], samples=[5, 9])
    r.ev(30, Event.ANOMALY, restart=0, anomaly="divergence", step=200, ranks=[2], agreed_at=204, action="healed")
    r.events[-1].update(source="rank 0", tensor="net.0.weight", hosts=["b"], suspect=[2])
    r.ev(31, Event.ANOMALY, restart=0, anomaly=7, step="x", skipped=[1, 2])  # hostile: read as missing, no traceback
    r.ev(50, Event.TRAINING_COMPLETED, restart=0, step=400).ev(51, Event.JOB_COMPLETED, relaunches=0)
    before = Records().ev(0, Event.LAUNCH).ev(5, Event.ATTEMPT_STARTED, restart=0).train(6, 10, 400, restart=0)
    before.ev(50, Event.TRAINING_COMPLETED, restart=0, step=400).ev(51, Event.JOB_COMPLETED, relaunches=0)
    rep, plain = r.report(summary=Summary(status="completed")), before.report(summary=Summary(status="completed"))
    assert [h.redone for h in rep.anomalies] == [30, 0, 0]
    assert rep.breakdown.redone == pytest.approx(plain.breakdown.redone + 30 * STEP_S)
    assert rep.breakdown.useful == pytest.approx(plain.breakdown.useful)
    said = text.format_run(rep)
    assert (
        "anomaly: nonfinite_loss on rank 1 at step 120 (then on rank(s) 0), agreed at step 130: rolled back to step 100"
        " (memory), 30 step(s) redone, 32 sample(s) skipped (epoch 1, 3840..3871 of its order)" in said
    ), said
    assert "replicas diverged at step 200 (ranks 2, first in net.0.weight), agreed at step 204: healed from rank 0" in said
    assert "suspect hardware: rank(s) 2" in said and "anomaly: ? on rank - at step -" in said
    from steadfast.report.plot import plot_run

    assert plot_run(rep, tmp_path / "report.png").stat().st_size > 0  # the loss plot marks them
