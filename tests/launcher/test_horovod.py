"""backend=horovod end to end: real Horovod processes started by horovod.run over Gloo."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from helpers import QUICK, committed_steps, env, event_of, events, reference_run, run_dir, run_train, summary, train_cmd

pytest.importorskip("horovod.torch", reason="Horovod is not installed: bash scripts/install_horovod.sh $(which python)")

HVD = [*QUICK, "backend=horovod"]
KILL_AT = 20  # after the first epoch's checkpoint (13 steps an epoch per worker in QUICK), before the second


@pytest.fixture(scope="module")
def hvd_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted 2-process Horovod run of the QUICK job."""
    return reference_run(tmp_path_factory, "hvd_baseline", *HVD)


@pytest.mark.slow
def test_two_process_run_completes_with_records(hvd_baseline: dict) -> None:
    s, folder = hvd_baseline["summary"], hvd_baseline["dir"]
    assert s["status"] == "completed" and s["epochs_completed"] == 4 and s["world_size"] == 2
    assert s["restarts"] == 0 and len(s["model_sha256"]) == 64
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "events.jsonl",
        "summary.json",
        "logs/rank0.log",
        "logs/rank1.log",
        "logs/horovod/attempt_0/rank.0/stderr",
        "logs/horovod/attempt_0/rank.1/stderr",
    ):
        assert (folder / name).is_file(), name
    assert committed_steps(folder)[-1] == s["global_step"]
    kinds = [e["event"] for e in events(folder)]
    assert kinds[0] == "launch" and "checkpoint_saved" in kinds and kinds[-1] == "job_completed"
    assert "relaunch" not in kinds


@pytest.mark.slow
def test_sigkilled_worker_is_relaunched_and_finishes_exactly(tmp_path: Path, hvd_baseline: dict) -> None:
    run_train(tmp_path, *HVD, "run.name=hvd_killed", "fault=kill_rank", "fault.rank=1", f"fault.at_step={KILL_AT}", check=True)
    folder = run_dir(tmp_path, "hvd_killed")
    kinds = [e["event"] for e in events(folder)]
    assert "checkpoint_saved" in kinds[: kinds.index("fault_fired")], "the kill must come after the first checkpoint"
    relaunch = event_of(folder, "relaunch", attempt=1)
    assert relaunch is not None and "rank 1" in relaunch["cause"] and "SIGKILL" in relaunch["cause"], relaunch
    resumed = event_of(folder, "resumed", restart=1)
    assert resumed is not None and resumed["step"] < KILL_AT
    s = summary(folder)
    assert s["status"] == "completed" and s["restarts"] >= 1 and s["epochs_completed"] == 4
    assert s["model_sha256"] == hvd_baseline["summary"]["model_sha256"]


@pytest.mark.extended
@pytest.mark.slow
def test_worker_exception_is_reported_with_rank_and_cause(tmp_path: Path) -> None:
    proc = run_train(tmp_path, *HVD, "run.name=hvd_exc", "fault=exception", "fault.rank=1", "fault.at_step=3", "restart=none")
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "InjectedFault" in proc.stderr, proc.stderr[-3000:]
    s = summary(run_dir(tmp_path, "hvd_exc"))
    assert s["status"] == "failed" and s["restarts"] == 0


@pytest.mark.slow
def test_same_model_as_torchrun(baseline: dict, hvd_baseline: dict) -> None:
    # With 2 workers both backends average gradients exactly ((a+b)/2 == a/2 + b/2 in binary
    # floating point), and the Comm skips Horovod's zero-gradient optimizer "initialisation" step.
    assert hvd_baseline["summary"]["model_sha256"] == baseline["summary"]["model_sha256"]


def _horovod_error(name: str, code: int) -> RuntimeError:
    return RuntimeError(
        "Horovod detected that one or more processes exited with non-zero status, thus causing the job "
        f"to be terminated. The first process to do so was:\nProcess name: {name}\nExit code: {code}\n"
    )


def test_root_cause_names_the_failing_rank_and_its_exception(tmp_path: Path) -> None:
    from hydra_plugins.steadfast_launcher._backends.horovod import root_cause

    for rank, last in (
        (0, "horovod.common.exceptions.HorovodInternalError: Horovod has been shut down."),
        (1, "steadfast.faults.InjectedFault: boom"),
    ):
        (tmp_path / f"rank.{rank}").mkdir()
        (tmp_path / f"rank.{rank}" / "stderr").write_text(
            f"[{rank}]<stderr>:log line\n[{rank}]<stderr>:User function raise error: xTraceback (most recent call last):\n"
            f'[{rank}]<stderr>:  File "x.py", line 1, in f\n[{rank}]<stderr>:{last}\n'
        )
    # rank 0 exited first, but only because rank 1 failed: the cause is rank 1's exception
    assert root_cause(_horovod_error("0", 1), tmp_path).startswith("rank 1: steadfast.faults.InjectedFault: boom")
    assert root_cause(_horovod_error("1", 1), tmp_path) == "rank 1 (exit code 1): steadfast.faults.InjectedFault: boom"
    assert root_cause(_horovod_error("2", 137), tmp_path) == "rank 2 (exit code 137, killed by SIGKILL): no error recorded"
    assert root_cause(_horovod_error("localhost[1]", 137), tmp_path) == "worker localhost[1] (exit code 137, killed by SIGKILL)"
    assert root_cause(ValueError("bad hosts\nmore"), tmp_path) == "horovod runner: ValueError: bad hosts"


def test_every_workers_exit_is_told_and_the_runners_own_stops_are_marked() -> None:
    """A rank killed by a signal is often not the one horovod.run's error names (a peer's collective
    fails at once and is reaped first): the runner's command function, patched, records every worker
    as it is reaped, and a SIGTERM after another worker failed is the runner stopping the rest."""
    from types import SimpleNamespace

    from hydra_plugins.steadfast_launcher._backends.horovod import worker_exits
    from hydra_plugins.steadfast_launcher._compat.horovod_runner import Exit, recording

    statuses = {0: 1, 1: 137, 2: 143, 3: 0, 4: -11}  # as reaped: a raise, SIGKILL, SIGTERM, done, SIGSEGV unwrapped
    exits: List[Exit] = []
    exec_command = recording(lambda settings: lambda command, slot, events: (statuses[slot.rank], 0.0), exits)(None)
    for rank in statuses:
        assert exec_command("cmd", SimpleNamespace(rank=rank), []) == (statuses[rank], 0.0)
    assert exits == [(0, 1, False), (1, 137, True), (2, 143, True), (3, 0, True), (4, -11, True)]
    told = {e.rank: (e.exit_code, e.stopped_by_backend) for e in worker_exits(exits)}
    assert told == {0: (1, False), 1: (-9, False), 2: (-15, True), 4: (-11, False)}
    assert worker_exits([(1, 143, False)])[0].stopped_by_backend is False  # the first to fail: its own SIGTERM


def test_workers_get_a_real_cycle_time_and_response_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """horovod.run (0.28.1) writes '(None,)' for both, which Horovod's C++ side reads as 0: a
    background thread that never waits between cycles and no response cache."""
    from horovod.runner import _HorovodArgs
    from horovod.runner.common.util import config_parser

    from hydra_plugins.steadfast_launcher._compat.horovod_runner import TUNING, tuned

    for key in TUNING:
        monkeypatch.delenv(key, raising=False)
    horovods: dict = {}
    config_parser.set_env_from_args(horovods, _HorovodArgs())
    assert horovods["HOROVOD_CYCLE_TIME"] == horovods["HOROVOD_CACHE_CAPACITY"] == "(None,)"  # the bug, still there
    ours: dict = {}
    tuned(config_parser.set_env_from_args)(ours, _HorovodArgs())
    assert float(ours["HOROVOD_CYCLE_TIME"]) > 0 and int(ours["HOROVOD_CACHE_CAPACITY"]) > 0
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2.5")  # the user's own value wins
    tuned(config_parser.set_env_from_args)(ours, _HorovodArgs())
    assert ours["HOROVOD_CYCLE_TIME"] == "2.5"


def test_the_launchers_gloo_check_gives_horovods_own_answer() -> None:
    """horovod.run asks whether Horovod was built with Gloo at every launch; the launcher answers
    with the same call in a new interpreter that does not import torch (see _compat/horovod_runner.py)."""
    from horovod.common.util import gloo_built as horovods_check

    from hydra_plugins.steadfast_launcher._compat.horovod_runner import gloo_built

    assert gloo_built() is True and horovods_check() is True  # scripts/install_horovod.sh builds with Gloo


HIDE_HOROVOD = '''
import sys
from importlib.machinery import PathFinder


class HideHorovod(PathFinder):
    """As if Horovod were not installed: find_spec finds nothing, import raises ModuleNotFoundError."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "horovod":
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [HideHorovod if f is PathFinder else f for f in sys.meta_path]
'''


def test_missing_horovod_fails_at_start_up_saying_how_to_install(tmp_path: Path) -> None:
    import subprocess

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_HOROVOD)
    e = env()
    e["PYTHONPATH"] = f"{site}:{e['PYTHONPATH']}"
    hidden = subprocess.run([train_cmd()[0], "-c", "import horovod"], env=e, capture_output=True, text=True)
    assert "ModuleNotFoundError" in hidden.stderr, "the sitecustomize should hide Horovod"
    proc = subprocess.run(train_cmd(*HVD), cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Horovod is not installed" in proc.stderr and "scripts/install_horovod.sh" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not [e for f in tmp_path.glob("outputs/*/events.jsonl") for e in events(f.parent) if e["event"] == "attempt_started"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["backend.np=0"], "backend.np"),
        (["backend.hosts=localhost:2", "backend.host_discovery_script=/bin/true"], "backend.host_discovery_script"),
        (["backend.min_np=3", "backend.max_np=2"], "backend.min_np=3 is greater than backend.max_np=2"),
        (["backend.min_np=2"], "backend.min_np (elastic mode) needs backend.host_discovery_script"),
        (["backend.controller=mpi"], "backend.controller"),
    ],
)
def test_bad_horovod_options_fail_at_start_up_naming_the_key(tmp_path: Path, overrides: list, needle: str) -> None:
    proc = run_train(tmp_path, "backend=horovod", *overrides, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.startswith("Invalid config") and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("outputs/*/events.jsonl")), "no worker may start"
