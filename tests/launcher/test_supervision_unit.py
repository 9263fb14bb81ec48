"""The pieces of preemption, the hang watchdog, the progress display and the report, in isolation.

The supervisor tests use real processes and real signals, but small ones (no torch, no launcher).
"""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Tuple

import pytest

from helpers import ROOT, env, events, wait_for
from hydra_plugins.steadfast_launcher._diagnosis import main_thread_frames, waits_in_collective
from hydra_plugins.steadfast_launcher._supervise import Supervisor
from steadfast.contract import env as launch_env
from steadfast.contract import files, heartbeat, stop
from steadfast.contract.schemas import RestartConf


# ---- the stop flag -----------------------------------------------------------------------------
def test_stop_signals_only_set_a_flag_and_handlers_are_restored() -> None:
    before = {s: signal.getsignal(s) for s in stop.STOP_SIGNALS}
    stop.clear_stop()
    previous = stop.install_stop_handlers()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test run if it did more than set the flag
        wait_for(lambda: stop.stop_requested(), 5, "the handler to run")
        os.kill(os.getpid(), signal.SIGINT)  # a second request does not change the first
        time.sleep(0.05)
        assert stop.stop_requested() == signal.SIGTERM
        assert abs(stop.stop_requested_at() - time.time()) < 5
    finally:
        stop.restore_handlers(previous)
        stop.clear_stop()
    assert {s: signal.getsignal(s) for s in stop.STOP_SIGNALS} == before
    assert stop.stop_requested() is None


def test_heartbeat_is_one_fixed_size_record_rewritten_in_place(tmp_path: Path) -> None:
    hb = heartbeat.Heartbeat(tmp_path / files.HEARTBEAT_DIR, 3)
    started = time.thread_time()  # what a beat costs this thread, not how often a loaded machine ran it
    for step in range(2000):
        hb.beat(step, "train")
    per_beat = (time.thread_time() - started) / 2000
    hb.beat(1999, "save")
    raw = (tmp_path / files.HEARTBEAT_DIR / "rank3").read_bytes()
    assert len(raw) == heartbeat.RECORD_BYTES and raw.endswith(b"\n")
    record = heartbeat.read_heartbeats(tmp_path)[3]
    assert record["step"] == 1999 and record["phase"] == "save" and record["beats"] == 2002 and record["pid"] == os.getpid()
    assert per_beat < 200e-6, f"a beat costs {per_beat * 1e6:.1f} us"


def test_a_heartbeat_torn_by_a_beat_being_written_is_never_read_as_a_record(tmp_path: Path) -> None:
    """The file is rewritten in place (mapped into memory): a reader can catch a beat half-written.
    Every mix of the record before and after that a reader could see is either one of the two or
    refused (its check fails); some mixes are valid JSON with a step and phase no beat wrote."""
    folder = tmp_path / files.HEARTBEAT_DIR
    hb = heartbeat.Heartbeat(folder, 0)
    hb.beat(1234, "train")
    before = (folder / "rank0").read_bytes()
    hb.beat(1299, "save")
    after = (folder / "rank0").read_bytes()
    whole = [heartbeat.parse_record(before), heartbeat.parse_record(after)]
    assert whole[0] is not None and whole[1] is not None and whole[1]["step"] == 1299
    made_up = 0  # mixes that are neither record yet parse as JSON: what a reader of plain JSON would have taken
    for cut in range(1, len(after)):
        torn = after[:cut] + before[cut:]
        if torn not in (before, after):
            try:
                made_up += isinstance(json.loads(torn), dict)
            except ValueError:
                pass
        assert heartbeat.parse_record(torn) in [*whole, None], cut  # one of the two, or refused
    assert made_up > 0  # the check, not JSON's syntax, is what refuses them
    (folder / "rank1").write_bytes(after.replace(b'"step": 1299', b'"step": 1290'))  # damaged: skipped
    assert set(heartbeat.read_heartbeats(tmp_path)) == {0}


def test_two_workers_writing_one_rank_s_heartbeat_leave_a_whole_record(tmp_path: Path) -> None:
    """A restarted rank's worker opens the file its predecessor may still write (a group being torn
    down): every beat writes a whole record, so the file holds the last writer's, never a mix."""
    folder = tmp_path / files.HEARTBEAT_DIR
    old, new = heartbeat.Heartbeat(folder, 0), heartbeat.Heartbeat(folder, 0)
    for step in range(3):
        old.beat(100 + step, "train")
    new.beat(-1, "init")
    old.beat(103, "train")  # the predecessor's last beat, after the new worker's first
    assert heartbeat.read_heartbeats(tmp_path)[0]["step"] == 103
    new.beat(0, "train")
    assert heartbeat.read_heartbeats(tmp_path)[0]["step"] == 0


def test_a_counted_step_writes_nothing_and_the_heartbeat_s_thread_writes_only_a_moved_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step only counts (no system call on the training thread); the heartbeat's thread
    writes the count, with its exact step, while the counting thread waits (as a rank hung in a
    collective); a count that stopped is never written again, so the thread cannot make a hung rank
    look alive."""
    hb = heartbeat.Heartbeat(tmp_path / files.HEARTBEAT_DIR, 0)
    hb.count(0)  # the first count: written at once, and the thread starts
    assert heartbeat.read_heartbeats(tmp_path)[0]["step"] == 0
    writes: List[Tuple[int, int]] = []  # (thread, beats) of every pwrite from here on
    pwrite = os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, at: writes.append((threading.get_ident(), hb._written)) or pwrite(fd, data, at)
    )
    wakes: List[int] = []  # the thread's looks at the count
    flush = heartbeat.Heartbeat.flush
    monkeypatch.setattr(heartbeat.Heartbeat, "flush", lambda self: wakes.append(self.beats) or flush(self))
    for step in range(1, 41):
        hb.count(step)
    assert not [w for w in writes if w[0] == threading.get_ident()], "a counted step wrote on the training thread"
    wait_for(lambda: heartbeat.read_heartbeats(tmp_path)[0]["step"] == 40, 30, "the heartbeat's thread to write step 40")
    record = heartbeat.read_heartbeats(tmp_path)[0]
    assert record["beats"] == hb.beats == 42 and record["phase"] == "train"
    published, looked = len(writes), len(wakes)
    wait_for(lambda: len(wakes) >= looked + 3, 30, "the heartbeat's thread to look at the count three more times")
    assert len(writes) == published and heartbeat.read_heartbeats(tmp_path)[0]["beats"] == 42  # nothing new: no progress shown
    hb.count(41, "validate")  # a new phase is written at once
    assert heartbeat.read_heartbeats(tmp_path)[0]["phase"] == "validate"


COUNTS_THEN_FORKS = r"""
import os, sys
from pathlib import Path
from typing import List, Tuple
from steadfast.contract import heartbeat as hb
beat = hb.Heartbeat(Path(sys.argv[1]), 0)
for step in range(5):
    beat.count(step)
with beat._lock:  # held at the fork, as the heartbeat's thread may hold it
    pid = os.fork()
if pid == 0:  # a DataLoader's worker: counts nothing of its own, never writes its parent's record
    beat.step, beat.beats = 999, beat.beats + 100
    ok = beat._lock.acquire(timeout=5)
    sys.exit(0 if ok and beat._publisher is None else 3)  # an ordinary exit: the atexit handlers run
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), hb.read_heartbeat(Path(sys.argv[1]) / "rank0")["step"], flush=True)
beat.count(7)  # not yet in the file: the exit writes it
"""


def test_a_forked_child_never_writes_its_parent_s_heartbeat_and_the_exit_writes_the_last_count(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", COUNTS_THEN_FORKS, str(tmp_path)], env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    child, step = proc.stdout.split()[1:]
    assert child == "0" and int(step) < 999  # the child's lock was free, and its exit wrote nothing
    assert heartbeat.read_heartbeat(tmp_path / "rank0")["step"] == 7


# ---- the start-up guard -------------------------------------------------------------------------
EARLY_STOP = r"""
import os, signal, sys, time
from pathlib import Path
from typing import List, Tuple
from steadfast.contract import heartbeat as hb, stop
from hydra_plugins.steadfast_launcher import _worker
run_dir = Path(sys.argv[1])
stop.install_stop_handlers()
os.kill(os.getpid(), signal.SIGTERM)  # the backend stops the group before this worker's guard is up
hb.start_heartbeat(run_dir, 0)  # phase "start"
_worker._guard_start_up(run_dir)
print("guard up", flush=True)
while True:  # blocked as in torch's C++ start-up: nothing here acts on the stop flag
    time.sleep(0.05)
"""


def test_a_stop_signal_before_the_start_up_guard_is_up_still_ends_the_worker(tmp_path: Path) -> None:
    """The stop handlers are installed first; a SIGTERM that lands before the guard is up was only
    seen by the handler's flag, and must still end a worker that has not started (torch elastic would
    otherwise wait out its 30 s before SIGKILL, and the restart would come that much later)."""
    e = env()
    e[launch_env.ENV_RUN_DIR], e[launch_env.ENV_LAUNCH_ID] = str(tmp_path), "L1"
    worker = subprocess.Popen(
        [sys.executable, "-c", EARLY_STOP, str(tmp_path)],
        env=e,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = worker.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        out, err = worker.communicate()
        pytest.fail(f"the worker was never ended by its start-up guard: {out} {err}")
    assert worker.returncode == 128 + signal.SIGTERM, (out, err)
    assert "SIGTERM during start-up" in err, err


# ---- reading stacks ------------------------------------------------------------------------------
def test_main_thread_is_found_in_a_faulthandler_dump(tmp_path: Path) -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    stop.set()
    frames = main_thread_frames(path.read_text())
    assert frames and frames[0][2] == "test_main_thread_is_found_in_a_faulthandler_dump"
    assert not waits_in_collective(frames)
    assert waits_in_collective([("/x/site-packages/torch/distributed/distributed_c10d.py", 1, "all_reduce")])


# ---- the supervisor, with small real processes ----------------------------------------------------
WORKER = r"""
import os, sys, time
from pathlib import Path
from typing import List, Tuple
from steadfast.contract import heartbeat as hb, stop
run_dir, mode = Path(sys.argv[1]), sys.argv[2]
stop.install_stop_handlers()
hb.start_heartbeat(run_dir, 0)
hb.enable_stack_dumps(run_dir, 0)
step = 0
while True:
    if stop.stop_requested() is not None and mode == "stops":
        (run_dir / "stopped").write_text(str(stop.stop_requested()))
        sys.exit(0)
    if mode == "hangs" and step >= 20:
        time.sleep(0.01)  # alive, no progress
        continue
    step += 1
    hb.heartbeat().beat(step)
    time.sleep(0.01)
"""


def _start_worker(run_dir: Path, mode: str, launch_id: str) -> subprocess.Popen:
    e = env()
    e[launch_env.ENV_RUN_DIR], e[launch_env.ENV_LAUNCH_ID] = str(run_dir), launch_id
    return subprocess.Popen([sys.executable, "-c", WORKER, str(run_dir), mode], env=e, cwd=ROOT)


def test_watchdog_finds_a_stuck_worker_writes_its_stack_and_kills_it(tmp_path: Path) -> None:
    conf = RestartConf(hang_timeout_s=1.5, startup_timeout_s=30)
    worker = _start_worker(tmp_path, "hangs", "L1")
    try:
        with Supervisor(tmp_path, conf, "L1") as sup:
            wait_for(lambda: worker.poll() is not None, 30, "the watchdog to kill the stuck worker")
        assert worker.returncode == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
    found = [e for e in events(tmp_path) if e["event"] == "hang_detected"]
    assert len(found) == 1 and found[0]["rank"] == 0 and found[0]["step"] == 20
    # still for the timeout less one look (0.1 s), never less; a look a loaded machine runs late adds its delay
    assert 1.5 - 0.1 <= found[0]["seconds_without_progress"] < 2 * 1.5, found
    assert "<string>" in found[0]["where"]
    stacks = (tmp_path / files.STACKS_DIR / "rank0.txt").read_text()
    assert "watchdog: rank 0" in stacks and 'File "<string>"' in stacks
    assert sup.first_hang and "rank 0 hung" in sup.first_hang
    ended = [e for e in events(tmp_path) if e["event"] == "attempt_ended"]
    assert ended and ended[0]["last_step"] == 20


def test_supervisor_ignores_another_launchs_heartbeats(tmp_path: Path) -> None:
    worker = _start_worker(tmp_path, "hangs", "someone-else")
    try:
        wait_for(lambda: heartbeat.read_heartbeats(tmp_path).get(0, {}).get("step", 0) >= 20, 30, "the worker to run")
        with Supervisor(tmp_path, RestartConf(hang_timeout_s=1.0), "L2"):
            time.sleep(2.0)  # longer than the timeout: nothing may happen to a worker that is not ours
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


def test_stop_request_is_forwarded_and_the_grace_is_enforced(tmp_path: Path) -> None:
    polite = _start_worker(tmp_path / "a", "stops", "L3")
    stubborn = _start_worker(tmp_path / "b", "hangs", "L4")  # takes the stop request but never acts on it
    stop.clear_stop()
    try:
        wait_for(
            lambda: heartbeat.read_heartbeats(tmp_path / "a") and heartbeat.read_heartbeats(tmp_path / "b"),
            30,
            "workers to register",
        )
        called = []
        with (
            Supervisor(tmp_path / "a", RestartConf(preemption_grace_s=1.0, hang_timeout_s=None), "L3"),
            Supervisor(
                tmp_path / "b",
                RestartConf(preemption_grace_s=1.0, hang_timeout_s=None),
                "L4",
                on_grace_expired=lambda: called.append(1) or False,
            ),
        ):
            stop.request_stop(signal.SIGTERM)
            wait_for(lambda: polite.poll() is not None and stubborn.poll() is not None, 30, "both workers to end")
        assert polite.returncode == 0 and (tmp_path / "a" / "stopped").read_text() == str(int(signal.SIGTERM))
        assert stubborn.returncode == -signal.SIGKILL and called == [1]
        assert [e["event"] for e in events(tmp_path / "b") if e["event"] == "preemption_grace_expired"]
        assert not [e for e in events(tmp_path / "a") if e["event"] == "preemption_grace_expired"]
    finally:
        stop.clear_stop()
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()


def test_new_restart_settings_are_checked() -> None:
    problems = RestartConf(preemption_grace_s=0, hang_timeout_s=0.5, startup_timeout_s=0, collective_timeout_s=0).problems()
    assert [p.split("=")[0] for p in problems] == [
        "restart.preemption_grace_s",
        "restart.hang_timeout_s",
        "restart.startup_timeout_s",
        "restart.collective_timeout_s",
    ]
    assert RestartConf(hang_timeout_s=None).problems() == []


def test_agent_leaves_stop_signals_to_the_launcher_and_waits_the_grace(tmp_path: Path) -> None:
    from hydra_plugins.steadfast_launcher._backends.torchrun import TorchrunBackendConf, launch_config

    config = launch_config(TorchrunBackendConf(), RestartConf(preemption_grace_s=12.5), "r", tmp_path)
    assert config.shutdown_timeout == 13
    assert "SIGTERM" not in config.signals_to_handle and "SIGINT" not in config.signals_to_handle


# ---- the progress display ------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_redrawn_and_cleared_for_log_records(monkeypatch: pytest.MonkeyPatch) -> None:
    from steadfast.telemetry._progress import ProgressDisplay

    monkeypatch.setenv("TERM", "xterm")
    stream = _Tty()
    console = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(console)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        display = ProgressDisplay("auto", every_s=0.0, total_steps=100, max_epochs=2, stream=stream)
        assert display.mode == "bar"
        for step in range(1, 4):
            display.update(step, 0, loss=1.5)
            display._last_draw = -1e9  # draw every update in this test
            time.sleep(0.26)
        logging.getLogger("pipeline").info("a log record")
        display.close()
    finally:
        root.removeHandler(console)
        root.setLevel(old_level)
    out = stream.getvalue()
    assert out.count("\r\x1b[K[") >= 3 and "step 3/100 (3%)" in out and "loss 1.5000" in out and "steps/s" in out
    assert "\r\x1b[Ka log record\n" in out  # the bar is cleared before a record prints
    assert "progress:" not in out  # the periodic plain lines go to the log file only


def test_progress_elsewhere_is_plain_periodic_lines(caplog: pytest.LogCaptureFixture) -> None:
    from steadfast.telemetry._progress import ProgressDisplay

    stream = io.StringIO()
    caplog.set_level(logging.INFO)
    display = ProgressDisplay("auto", every_s=3600, total_steps=50, max_epochs=1, stream=stream)
    assert display.mode == "lines"
    for step in range(1, 51):
        display.update(step, 0, loss=0.25 if step % 10 == 0 else None)
    display.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "steadfast.progress"]
    assert lines == ["progress: epoch 1/1 | step 1/50 (2%) | loss - | - steps/s | ETA ?"]  # once per every_s
    assert stream.getvalue() == ""  # nothing written around the logging system
    off = ProgressDisplay("auto", 0, 50, 1, enabled=False, stream=stream)
    off.update(1, 0)
    assert off.mode == "none" and stream.getvalue() == ""


# ---- the report, on records written here --------------------------------------------------------
def _write_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    t = 1000.0
    ev = [
        dict(time=t, event="launch"),
        dict(time=t + 5, event="attempt_started", restart=0),
        dict(time=t + 6, event="first_step", restart=0, step=1),
        dict(time=t + 7, event="checkpoint_saved", restart=0, step=10, seconds=0.5, pid=1),
        dict(time=t + 8, event="fault_fired", restart=0, fault="kill", rank=1, step=15),
        dict(time=t + 9, event="attempt_ended", restart=0, last_step=15),
        dict(time=t + 14, event="attempt_started", restart=1),
        dict(time=t + 14.5, event="resumed", restart=1, step=10),
        dict(time=t + 15, event="first_step", restart=1, step=11),
        dict(time=t + 16, event="preempted", restart=1, step=18, signal="SIGTERM", saved=True),
        dict(time=t + 16, event="checkpoint_saved", restart=1, step=18, seconds=0.5, pid=2),
        dict(time=t + 17, event="attempt_ended", restart=1, last_step=18),
        dict(time=t + 17.5, event="job_interrupted", signal="SIGTERM"),
        dict(time=t + 100, event="launch"),
        dict(time=t + 104, event="attempt_started", restart=0),
        dict(time=t + 104.5, event="resumed", restart=0, step=18),
        dict(time=t + 105, event="first_step", restart=0, step=19),
        dict(time=t + 108, event="checkpoint_saved", restart=0, step=30, seconds=0.5, pid=3),
        dict(time=t + 108, event="training_completed", restart=0, step=30),
        dict(time=t + 109, event="attempt_ended", restart=0, last_step=30),
        dict(time=t + 110, event="job_completed"),
    ]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    rows = [dict(time=t + 6 + 0.1 * s, step=s, loss=2.0 - 0.01 * s, restart=0) for s in range(1, 16)]
    rows += [dict(time=t + 15 + 0.1 * (s - 11), step=s, loss=2.0 - 0.01 * s, restart=1) for s in range(11, 19)]
    rows += [dict(time=t + 105 + 0.1 * (s - 19), step=s, loss=2.0 - 0.01 * s, restart=0) for s in range(19, 31)]
    rows += [dict(time=t + 108, step=30, epoch=0, train_loss=1.8, val_loss=1.9, restart=0)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut by a cra')
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "global_step": 30, "epochs_completed": 1}))


def test_report_counts_attempts_lost_work_and_time_from_the_records(tmp_path: Path) -> None:
    from steadfast import report
    from steadfast.report import plot

    folder = tmp_path / "run"
    _write_run(folder)
    r = report.report(folder)
    assert len(r.launches) == 2 and r.restarts == 1 and len(r.attempts) == 3
    a0, a1, a2 = r.attempts
    assert (a0.outcome, a0.resumed_from, a0.last_step, a0.lost_steps) == ("failed", 0, 15, 5)
    assert a0.cause == "fault=kill on rank 1 at step 15"
    assert (a1.outcome, a1.resumed_from, a1.last_step, a1.lost_steps) == ("preempted", 10, 18, 0)
    assert (a2.outcome, a2.resumed_from, a2.last_step) == ("completed", 18, 30)
    b = r.breakdown
    assert b.wall == pytest.approx(17.5 + 10)
    assert b.useful == pytest.approx(30 * 0.1) and b.redone == pytest.approx(5 * 0.1)
    assert b.checkpoint == pytest.approx(1.5) and b.startup == pytest.approx(6 + 6 + 5)
    assert sum(b.part(k) for k in b.parts()) == pytest.approx(b.wall)
    text = report.format_run(r)
    assert "restarts 1" in text and "preemptions 1" in text and "fault=kill on rank 1 at step 15" in text
    assert "metrics.jsonl: 1 line(s) that are not a JSON object skipped" in text  # the line cut by a crash
    png = plot.plot_run(r, folder / "report.png")
    assert png.stat().st_size > 20_000
    sweep = plot.plot_sweep([r, r], tmp_path / "report.png")
    assert sweep.stat().st_size > 20_000


def test_verify_recovery_splits_the_fault_schedule_from_the_job() -> None:
    from steadfast.verify_recovery import split_overrides

    job, fault = split_overrides(["trainer.lr=0.1", "fault=kill_rank", "fault.at_step=3", "+fault.x=1", "data=synthetic"])
    assert job == ["trainer.lr=0.1", "data=synthetic"] and fault == ["fault=kill_rank", "fault.at_step=3", "+fault.x=1"]


AGENT_LOGS_A_FAILURE = """
import logging, sys
import torch.distributed.elastic.multiprocessing.api  # what the launcher imports to run the agent
from hydra_plugins.steadfast_launcher._compat.torch_logging import render_tracebacks_first
if sys.argv[1] == "rendered":
    render_tracebacks_first("torch.distributed.elastic")
log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
try:
    raise RuntimeError("worker 1 failed")
except RuntimeError:
    log.exception("failed (exitcode: 1) local_rank: 1")
print("dynamo imported" if "torch._dynamo" in sys.modules else "dynamo not imported")
"""


def test_a_worker_failure_logged_by_the_agent_reads_the_same_without_importing_dynamo() -> None:
    """torch's log formatter imports torch._dynamo (about 1 s) to format a record with a traceback;
    the torch elastic agent logs every worker failure so, and the first restart of a launch waited."""
    outputs = {}
    for mode in ("rendered", "plain"):
        proc = subprocess.run(
            [sys.executable, "-c", AGENT_LOGS_A_FAILURE, mode], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        outputs[mode] = proc
    assert outputs["rendered"].stdout.strip() == "dynamo not imported"
    assert outputs["plain"].stdout.strip() == "dynamo imported"  # what it fixes: still so in this torch

    def text(stderr: str) -> list:  # each line without its time and process id
        return [line.split("] ", 1)[-1] for line in stderr.splitlines()]

    assert text(outputs["rendered"].stderr) == text(outputs["plain"].stderr)
    assert "RuntimeError: worker 1 failed" in outputs["rendered"].stderr and "Traceback" in outputs["rendered"].stderr
