"""Adding a backend is one module and one YAML file; adding an event field is one line in its record
type. Shown here by doing it: a toy backend written into a scratch folder (not shipped) is composed,
validated and launched by the real entrypoint; a new field of an event kind is refused by the writer
until its record type declares it."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from helpers import env, run_train
from steadfast.contract import backends, events, keys
from steadfast.contract.events import Event

# One module: under a `hydra_plugins` package, so Hydra's plugin scan imports it at start-up.
TOY_MODULE = '''
"""backend=toy: one worker in the launcher's process, told who it is in the toy's own variables."""
import os
from dataclasses import dataclass
from typing import List

from hydra_plugins.steadfast_launcher.backends import (
    Attempt, Backend, BackendConf, BackendSpec, Completed, Failed, Outcome, RankEnv, Stopped, register,
)
from steadfast.contract.env import NONE
from steadfast.contract.schemas import bad

RANK_ENV = RankEnv(rank="TOY_RANK", world_size="TOY_SIZE", local_rank="TOY_LOCAL_RANK",
                   local_world_size="TOY_LOCAL_SIZE", address="TOY_ADDR", port="TOY_PORT")


@dataclass
class ToyBackendConf(BackendConf):
    name: str = "toy"
    ranks: int = 1

    def problems(self, prefix: str = "backend") -> List[str]:
        out = super().problems(prefix)
        if self.ranks != 1:
            out.append(bad(f"{prefix}.ranks", self.ranks, "1 (the toy runs one worker)"))
        return out


@register
class ToyBackend(Backend):
    spec = BackendSpec(name="toy", schema=ToyBackendConf, collective=NONE, world_size_keys=("ranks",), rank_env=RANK_ENV)
    in_process = True

    def launch(self, attempt: Attempt) -> Outcome:
        told = {RANK_ENV.rank: "0", RANK_ENV.world_size: "1", RANK_ENV.local_rank: "0", RANK_ENV.local_world_size: "1",
                RANK_ENV.address: "toyhost", RANK_ENV.port: "4321"}
        os.environ.update({**attempt.env, **told})
        try:
            value = attempt.entry(attempt.payload, restore_hydra=False)
        except Exception as exc:
            return Failed(f"the toy's worker: {exc}")
        finally:
            for key in told:
                os.environ.pop(key, None)
        return value if isinstance(value, Stopped) else Completed(value)
'''
# One YAML file: the backend group's option, extending the schema the module registered.
TOY_YAML = """
defaults:
  - schema_toy
  - _self_
ranks: 1
"""
QUICK = ["data=synthetic", "data.num_samples=128", "trainer.max_epochs=1", "checkpoint=every_epoch", "snapshot=off"]


def _toy(tmp_path: Path) -> Dict[str, str]:
    plugins = tmp_path / "plugins" / "hydra_plugins"
    plugins.mkdir(parents=True)
    (plugins / "steadfast_toy_backend.py").write_text(textwrap.dedent(TOY_MODULE))
    conf = tmp_path / "conf" / "backend"
    conf.mkdir(parents=True)
    (conf / "toy.yaml").write_text(TOY_YAML)
    e = env()
    e["PYTHONPATH"] = f"{tmp_path / 'plugins'}:{e['PYTHONPATH']}"
    return e


def _train(tmp_path: Path, e: Dict[str, str], *overrides: str) -> Any:
    import subprocess
    import sys

    searchpath = f"hydra.searchpath=[pkg://steadfast.conf,file://{tmp_path / 'conf'}]"
    cmd = [sys.executable, "-m", "pipeline.train", searchpath, "backend=toy", *QUICK, *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)


def test_a_toy_backend_is_one_module_and_one_yaml_file(tmp_path: Path) -> None:
    e = _toy(tmp_path)
    # validated: the toy's schema checks its own key before any worker starts, and nothing is written
    refused = _train(tmp_path, e, "backend.ranks=2")
    assert refused.returncode != 0
    assert "Invalid config: backend.ranks=2 is not allowed: 1 (the toy runs one worker)" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())
    # composed and launched: its world-size key names the run (the key table asked the registry),
    # its worker read who it is from the toy's own variables (the launcher named them)
    done = _train(tmp_path, e, "backend.ranks=1")
    assert done.returncode == 0, done.stderr[-4000:]
    (run,) = (tmp_path / "outputs").iterdir()
    assert run.name == "backend.ranks=1,backend=toy,data.num_samples=128,data=synthetic", run.name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 1 and summary["epochs_completed"] == 1
    recorded = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    launch = next(r for r in recorded if r["event"] == "launch")
    met = next(r for r in recorded if r["event"] == "rendezvous")
    assert launch["backend"] == "toy" and (met["world_size"], met["endpoint"]) == (1, "toyhost:4321")
    assert "name: toy" in (run / "config.yaml").read_text()


@dataclasses.dataclass
class _ToyConf(backends.BackendConf):
    name: str = "toy_unit"
    lanes: int = 1


def test_the_contract_asks_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    assert keys.names_run("backend.lanes") is False and _ToyConf().problems()  # not registered: a key like any other
    rank_env = backends.RankEnv(rank="R", world_size="W", local_rank="LR", local_world_size="LW")
    backends.register(backends.BackendSpec("toy_unit", _ToyConf, "none", ("lanes",), rank_env))
    assert keys.names_run("backend.lanes") is True and keys.checked_on_resume("backend.lanes") is False
    assert _ToyConf().problems() == [] and "toy_unit" in backends.names()
    with pytest.raises(ValueError, match="registered by"):  # another module may not take its name
        backends.register(backends.BackendSpec("toy_unit", type("Other", (_ToyConf,), {}), "none", (), rank_env))


def test_the_rank_variables_travel_with_the_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from steadfast.contract.env import LaunchEnv

    names = backends.RankEnv(rank="R", world_size="W", local_rank="LR", local_world_size="LW", restart_count="RC")
    exported = LaunchEnv(backend="x", collective="none", run_dir=Path("/r"), attempt=1, rank_env=names).to_environ()
    monkeypatch.setattr("os.environ", {**exported, "R": "3", "W": "4", "LR": "1", "LW": "2", "RC": "5", "RANK": "9"})
    launch = LaunchEnv.current()
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (3, 4, 1, 2)
    assert launch.restart_count == 6 and launch.rank_env == names


# ---- events ----------------------------------------------------------------------------------------


def test_the_writer_checks_every_event_against_its_record_type(tmp_path: Path) -> None:
    events.append(tmp_path, Event.FIRST_STEP, step=3, seconds_since_launch=1.5, restart=0)
    with pytest.raises(TypeError, match="no field.*stepp"):
        events.append(tmp_path, Event.FIRST_STEP, stepp=3)
    with pytest.raises(TypeError, match="step='3'"):
        events.append(tmp_path, Event.FIRST_STEP, step="3")
    events.append(tmp_path, Event.WORLD_SIZE_CHANGED, step=4, policy="keep_global_batch")  # an open kind: the app's notes
    events.write(tmp_path, events.Relaunch(attempt=1, cause="rank 1 failed"))
    first, changed, relaunch = events.records(tmp_path)
    assert isinstance(first, events.FirstStep) and (first.step, first.seconds_since_launch, first.restart) == (3, 1.5, 0)
    assert isinstance(changed, events.WorldSizeChanged) and changed.extra == {"policy": "keep_global_batch"}
    assert isinstance(relaunch, events.Relaunch) and relaunch.cause == "rank 1 failed" and relaunch.pid > 0


def test_a_value_of_the_wrong_type_reads_back_as_none(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"time": 1.0, "event": "hang_detected", "rank": "zero", "step": 7, "other": 1}) + "\n"
    )
    (hang,) = events.records(tmp_path)
    assert isinstance(hang, events.HangDetected) and (hang.rank, hang.step, hang.extra) == (None, 7, {"other": 1})


def test_a_new_event_field_is_one_line_in_its_record_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="no field.*note"):
        events.append(tmp_path, Event.FIRST_STEP, step=1, note="warm")

    @dataclasses.dataclass(frozen=True)
    class FirstStep(events.FirstStep):
        note: Optional[str] = None  # the new field: the one place it is added

    monkeypatch.setitem(events.RECORDS, Event.FIRST_STEP, FirstStep)
    events.append(tmp_path, Event.FIRST_STEP, step=1, note="warm")
    (record,) = events.records(tmp_path)
    assert isinstance(record, FirstStep) and record.note == "warm" and record.fields() == {"step": 1, "note": "warm"}


def test_every_kind_has_a_record_type_and_one_place_lists_the_kinds() -> None:
    assert set(events.RECORDS) == set(Event)
    kinds: List[str] = [cls.KIND.value for cls in events.RECORDS.values()]
    assert len(kinds) == len(set(kinds))


def test_pipeline_runs_without_the_toy(tmp_path: Path) -> None:
    """The toy is not shipped: without its module, backend=toy is not a choice."""
    proc = run_train(tmp_path, "backend=toy", *QUICK)
    assert proc.returncode != 0 and "toy" in proc.stderr
