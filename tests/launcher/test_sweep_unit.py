"""Sweep machinery without workers: naming, sweep detection, packing, the ledger, the table."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
from pathlib import Path

import pytest

from helpers import ROOT, run_train
from hydra_plugins.steadfast_launcher import _ledger, _packing, _sweep
from steadfast.contract.exits import exit_code
from steadfast.contract.naming import is_sweep, run_name, sweep_dir, sweep_name

# the built-in trainer's own neutral keys (conf/train.yaml, run.safe_to_change)
SAFE = list(__import__("omegaconf").OmegaConf.load(ROOT / "conf" / "train.yaml").run.safe_to_change)


@pytest.mark.parametrize(
    "overrides,sweeper,params,expected",
    [
        (["trainer.lr=0.1"], "basic", None, False),
        ([], None, None, False),
        (["trainer.lr=0.1,0.01"], "basic", None, True),
        (["model=mlp,cnn"], "basic", None, True),
        (["+experiment=a,b"], "basic", None, True),
        (["trainer.seed=range(3)"], "basic", None, True),
        (["trainer.lr=interval(0.01,0.1)"], "optuna", None, True),
        (["backend.hosts='a:1,b:1'"], "basic", None, False),  # a quoted string with a comma is one value
        (["model.hidden_sizes=[32,32]"], "basic", None, False),  # a list value, not a sweep
        ([], "optuna", None, True),
        ([], "basic", {"trainer.lr": "0.1,0.01"}, True),
    ],
)
def test_is_sweep(overrides: list, sweeper: str, params: dict, expected: bool) -> None:
    assert is_sweep(overrides, sweeper, params) is expected


def test_a_single_run_keeps_its_folder_and_a_sweep_gets_its_own() -> None:
    assert sweep_dir("outputs", ["trainer.lr=0.1", "model=cnn"]) == "outputs"
    assert run_name(["trainer.lr=0.1", "model=cnn"]) == "model=cnn,trainer.lr=0.1"
    swept = sweep_dir("outputs", ["trainer.lr=0.1,0.01", "model=mlp,cnn"], "basic", None)
    assert swept == "outputs/sweeps/model=mlp-cnn,trainer.lr=0.1-0.01"
    # the order on the command line does not matter; no timestamps: the same command, the same folder
    assert swept == sweep_dir("outputs", ["model=mlp,cnn", "trainer.lr=0.1,0.01"], "basic", None)


def test_sweep_name_leaves_out_keys_that_do_not_change_training_unless_swept() -> None:
    base = sweep_name(["trainer.lr=0.1,0.01"], safe_to_change=SAFE)
    assert (
        sweep_name(["trainer.lr=0.1,0.01", "trainer.max_epochs=40", "restart=none"], safe_to_change=SAFE) == base
    )  # continues the sweep
    assert "trainer.max_epochs=5-10" in sweep_name(
        ["trainer.lr=0.1", "trainer.max_epochs=5,10"], safe_to_change=SAFE
    )  # swept: kept
    assert sweep_name([], "optuna", {"trainer.lr": "interval(0.01, 0.1)"}).startswith("optuna,trainer.lr=interval")
    long = sweep_name([f"key{i}=a,b" for i in range(30)])
    assert len(long) <= 80 and long != sweep_name([f"key{i}=a,b" for i in range(31)])


def test_packing_never_oversubscribes_the_machine() -> None:
    box = _packing.Machine("cpu", [0, 1])
    jobs = [(0, 2), (1, 2)]
    assert _packing.pick(jobs, box, running=0, max_parallel=2) == 0
    box.take(2)
    assert _packing.pick(jobs[1:], box, running=1, max_parallel=2) is None  # 2 + 2 > 2 cores: waits
    box.give_back([0, 1])
    assert _packing.pick(jobs[1:], box, running=0, max_parallel=2) == 1
    small = _packing.Machine("cpu", [0, 1])
    assert small.take(1) == [0] and _packing.pick([(3, 1)], small, running=1, max_parallel=2) == 3
    assert _packing.pick([(3, 1)], small, running=1, max_parallel=1) is None  # max_parallel_jobs
    big = _packing.Machine("cpu", [0, 1])
    assert _packing.pick([(4, 8)], big, running=0, max_parallel=2) == 4  # bigger than the machine: alone
    big.take(8)
    assert _packing.pick([(4, 8), (5, 1)], big, running=1, max_parallel=2) is None
    # first fit: a later job that fits goes first; a job whose folder is in use waits
    box = _packing.Machine("cpu", [0, 1, 2])
    box.take(2)
    assert _packing.pick([(6, 2), (7, 1)], box, running=1, max_parallel=3) == 7
    assert _packing.pick([(7, 1)], box, running=1, max_parallel=3, busy=["f"], folders={7: "f"}) is None


def test_machine_counts_gpus_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    m = _packing.machine(None)
    assert m.kind == "gpu" and m.capacity == 2 and m.labels == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _packing.machine(None).kind == "cpu"
    assert _packing.machine(3).capacity == 3 and _packing.machine(3).kind == "slots"


def test_ledger_is_written_atomically_and_survives_a_reload(tmp_path: Path) -> None:
    led = _ledger.Ledger(tmp_path, {"sweep_dir": str(tmp_path)})
    led.update("a=1", overrides=["a=1"], status=_ledger.RUNNING, attempts=1)
    led.update("a=1", status=_ledger.COMPLETED, **_ledger.encode_result(0.25))
    led.update("a=2", overrides=["a=2"], status=_ledger.COMPLETED, **_ledger.encode_result({1, 2}))  # not JSON
    led.update("a=3", overrides=["a=3"], status=_ledger.COMPLETED, **_ledger.encode_result((1, {"k": 2.5})))
    assert not list(tmp_path.glob(".*.tmp"))
    again = _ledger.Ledger(tmp_path, {})
    assert again.get("a=1")["status"] == "completed" and again.get("a=1")["attempts"] == 1
    assert _ledger.decode_result(again.get("a=1")) == (True, 0.25)
    # a result that is not plain JSON is recorded as unavailable (with its repr): the job runs again
    assert _ledger.decode_result(again.get("a=2")) == (False, None) and again.get("a=2")["result_repr"] == "{1, 2}"
    assert _ledger.decode_result(again.get("a=3")) == (True, [1, {"k": 2.5}])  # JSON-able values as they are
    (tmp_path / _ledger.LEDGER_FILE).write_text("{ half a file")
    fresh = _ledger.Ledger(tmp_path, {})
    assert fresh.get("a=1") is None and list(tmp_path.glob("sweep_ledger.json.unreadable-*"))


def test_ledger_results_are_only_ever_json(tmp_path: Path) -> None:
    import numpy as np

    assert _ledger.encode_result(np.float32(0.5))["result"] == 0.5 and _ledger.encode_result(np.int64(3))["result"] == 3
    assert _ledger.encode_result(object())["result_unavailable"] is True
    assert _ledger.encode_result({1: "int keys"})["result_unavailable"] is True
    nan = _ledger.encode_result(float("nan"))
    assert nan["result_unavailable"] is False and nan["result"] != nan["result"]


def test_malformed_ledger_records_are_ignored_never_raised(tmp_path: Path) -> None:
    good = {
        "overrides": ["a=1"],
        "run_dir": "a=1",
        "job_num": 0,
        "config_sha256": "x",
        "status": "completed",
        "attempts": 1,
        "restarts": 0,
        "result": 0.5,
        "error": None,
    }
    bad = [
        {**good, "attempts": "1"},
        {**good, "status": "done"},
        {**good, "overrides": "a=1"},
        {**good, "run_dir": 3},
        {**good, "started_at": "yesterday"},
        {**good, "restarts": -1},
        {**good, "result_unavailable": "no"},
        {**good, "unknown_field": 1},
        {**good, "job_num": True},
        "not an object",
        None,
        [],
    ]
    jobs = {"good": good, **{f"bad{i}": r for i, r in enumerate(bad)}}
    (tmp_path / _ledger.LEDGER_FILE).write_text(json.dumps({"version": 1, "created": "then", "jobs": jobs}))
    led = _ledger.Ledger(tmp_path, {})
    assert list(led.data["jobs"]) == ["good"] and led.get("good")["result"] == 0.5
    assert isinstance(led.data["created"], float)
    for text in ("[]", '{"jobs": []}', "null", '"x"'):
        (tmp_path / _ledger.LEDGER_FILE).write_text(text)
        assert _ledger.Ledger(tmp_path, {}).data["jobs"] == {}
    assert len(list(tmp_path.glob("sweep_ledger.json.unreadable-*"))) == 4  # each kept aside, none overwritten
    os.mkfifo(tmp_path / _ledger.LEDGER_FILE)  # not a regular file: never blocks, set aside
    assert _ledger.Ledger(tmp_path, {}).data["jobs"] == {}


def test_a_pickled_result_in_the_ledger_is_never_unpickled(tmp_path: Path) -> None:
    """A record written by an earlier launcher, or crafted, with `result_pickle`: unavailable."""
    marker = tmp_path / "pwned"
    crafted = base64.b64encode(pickle.dumps(_Exploit(str(marker)))).decode()
    record = {"overrides": ["a=1"], "run_dir": "a=1", "status": "completed", "result": "0.5", "result_pickle": crafted}
    (tmp_path / _ledger.LEDGER_FILE).write_text(json.dumps({"jobs": {"a=1": record}}))
    led = _ledger.Ledger(tmp_path, {})
    assert _ledger.decode_result(led.get("a=1")) == (False, None)
    assert not marker.exists()


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_job_key_ignores_order() -> None:
    assert _ledger.job_key(["b=2", "a=1"]) == _ledger.job_key(["a=1", "b=2"])


def test_table_lines_up() -> None:
    text = _sweep.format_table(
        [
            dict(
                job=0,
                overrides="trainer.lr=0.1",
                status="completed",
                restarts=0,
                result=_sweep.describe_result(0.123456789),
                folder="x",
            ),
            dict(job=11, overrides="trainer.lr=0.01", status="failed", restarts=3, result="", folder="y"),
        ]
    )
    lines = text.splitlines()
    assert lines[0].split() == ["job", "overrides", "status", "restarts", "result", "run", "folder"]
    assert "0.123457" in lines[2] and lines[3].lstrip().startswith("11")
    assert len({line.index(word) for line, word in zip(lines[2:], ("completed", "failed"))}) == 1  # one column


def test_exit_codes() -> None:
    assert exit_code(signal.SIGTERM) == 75 and exit_code(signal.SIGINT) == 130


def test_bad_launcher_settings_fail_before_any_worker(tmp_path: Path) -> None:
    proc = run_train(tmp_path, "hydra.launcher.max_parallel_jobs=0", timeout=60)
    assert proc.returncode != 0 and "hydra.launcher.max_parallel_jobs=0 is not allowed" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("outputs/*/events.jsonl"))


def test_jobs_that_would_share_a_run_folder_are_refused(tmp_path: Path) -> None:
    # trainer.max_epochs does not change the run name (running longer continues a run), so a
    # sweep over it alone would put both jobs in one folder: refused before anything starts.
    proc = run_train(tmp_path, "-m", "trainer.max_epochs=2,3", "data=synthetic", timeout=60)
    assert proc.returncode != 0 and "would share the run folder" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("outputs/sweeps/*/*/events.jsonl"))


@pytest.mark.extended
def test_ledger_record_of_a_sweep_names_the_command_and_a_crafted_pickle_is_never_run(tmp_path: Path) -> None:
    args = [
        "-m",
        "backend=local",
        "data=synthetic",
        "data.num_samples=128",
        "trainer.max_epochs=1",
        "checkpoint=every_epoch",
        "trainer.seed=0,1",
    ]
    run_train(tmp_path, *args, check=True)
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    path = sweep / "sweep_ledger.json"
    data = json.loads(path.read_text())
    assert data["command"]["task"][-1] == "trainer.seed=0,1"
    assert sorted(r["job_num"] for r in data["jobs"].values()) == [0, 1]
    assert all(r["status"] == "completed" and isinstance(r["result"], float) for r in data["jobs"].values())
    # Someone who can edit the ledger plants a pickle that would create a file when unpickled.
    marker = tmp_path / "unpickled"
    (key0, rec0), (key1, rec1) = sorted(data["jobs"].items(), key=lambda kv: kv[1]["job_num"])
    rec0["result_pickle"] = base64.b64encode(pickle.dumps(_Exploit(str(marker)))).decode()
    path.write_text(json.dumps(data))
    again = run_train(tmp_path, *args, check=True)
    assert not marker.exists(), "a result from the ledger was unpickled"
    jobs = json.loads(path.read_text())["jobs"]
    assert jobs[key0]["attempts"] == 2 and "result_pickle" not in jobs[key0]  # launched again (resumed), result now JSON
    assert jobs[key0]["status"] == "completed" and isinstance(jobs[key0]["result"], float)
    assert jobs[key1]["attempts"] == 1  # the other one skipped
    assert " skipped " in again.stdout + again.stderr
