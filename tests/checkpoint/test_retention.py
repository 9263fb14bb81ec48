"""Retention that keeps the best checkpoints by a metric (issue 34: checkpoint.keep_best, monitor, mode):
the pure rule (steadfast/checkpoint/retention.py), the manifest's `metric` field, retention over real
files in one process, and one run of the built-in trainer on 2 torchrun workers with a restart."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from helpers import QUICK, Box, committed_steps, run_dir, run_train, summary
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint.manager import CheckpointManager
from steadfast.checkpoint.retention import Policy, Saved, kept, ranked
from steadfast.distributed.comm import Comm


def saved(step: int, value: Optional[float] = None, metric: Optional[str] = "val_loss", **kw: Any) -> Saved:
    return Saved(step, kw.pop("commit", step), metric=metric, value=value, **kw)


BEST2 = Policy(keep_last=1, keep_best=2, monitor="val_loss")


# ---- the pure rule ---------------------------------------------------------------------------------
def test_the_best_by_the_metric_are_kept_besides_the_newest() -> None:
    history = [saved(10, 0.9), saved(20, 0.4), saved(30, 0.7), saved(40, 0.5), saved(50, 0.8)]
    assert kept(history, BEST2) == {50, 20, 40}  # the newest, and the two lowest
    assert kept(history, Policy(keep_last=1, keep_best=2, monitor="val_loss", mode="max")) == {50, 10}
    assert kept(history, Policy(keep_last=3, keep_best=2, monitor="val_loss")) == {30, 40, 50, 20}  # a union
    assert kept(history, Policy(keep_last=1)) == {50}  # keep_best=0: as before
    assert kept(history, Policy(keep_last=1, keep_best=2)) == {50}  # no monitor, nothing ranks


def test_ties_go_to_the_earlier_step() -> None:
    history = [saved(10, 0.5), saved(20, 0.3), saved(30, 0.5), saved(40, 0.3), saved(50, 0.9)]
    assert [s.step for s in ranked(history, BEST2)] == [20, 40, 10, 30, 50]
    assert kept(history, BEST2) == {50, 20, 40}
    assert kept(history, Policy(keep_last=1, keep_best=3, monitor="val_loss")) == {50, 20, 40, 10}


def test_nan_inf_missing_and_other_metrics_never_rank_as_best() -> None:
    history = [
        saved(10, float("nan")),
        saved(20, float("-inf")),  # would be the lowest of all
        saved(30, None),  # nothing logged since the save before
        saved(40, 0.1, metric="train_loss"),  # another metric (the monitor changed since)
        saved(50, 0.6),
        saved(60, None, metric=None),  # a manifest of an earlier version: no metric at all
    ]
    assert [s.step for s in ranked(history, BEST2)] == [50]
    assert kept(history, BEST2) == {60, 50}  # one ranks: one kept as best; none is filled in
    assert kept(history, Policy(keep_last=1, keep_best=2, monitor="val_loss", mode="max")) == {60, 50}


def test_the_rules_that_existed_still_hold_beside_the_best() -> None:
    """The newest by step, the resume's pick (newest by commit), milestones, and what the caller pins."""
    history = [
        saved(100, 0.9, commit=9),  # a resume picks it: the newest commit (a run started again at step 100)
        saved(300, 0.8, commit=3, epoch=4),  # the newest by step, a milestone of keep_every_n_epochs=2
        saved(250, 0.7, commit=8, epoch=3, batch_in_epoch=5),
        saved(200, 0.2, commit=2, epoch=2),  # the best; a milestone too
        saved(150, 0.3, commit=1),  # the second best
        saved(120, 0.5, commit=7),
    ]
    assert kept(history, Policy(keep_last=1)) == {300, 100}
    assert kept(history, Policy(keep_last=1, keep_best=2, monitor="val_loss")) == {300, 100, 200, 150}
    assert kept(history, Policy(1, 2, keep_best=1, monitor="val_loss"), pinned=[120]) == {300, 100, 200, 120}
    assert kept([], BEST2, pinned=[7]) == {7}


def test_applied_after_every_save_it_keeps_what_it_would_keep_of_the_whole_history() -> None:
    """Nothing retention removes is wanted back by a later save: removing after each save (as the
    manager does) leaves what the rule keeps of every checkpoint ever saved. Values with ties, NaN
    and gaps, in both modes."""
    rng = random.Random(34)
    for trial in range(200):
        policy = Policy(rng.randint(1, 3), rng.choice([None, 2, 3]), rng.randint(0, 4), "val_loss", rng.choice(["min", "max"]))
        on_disk: List[Saved] = []
        history: List[Saved] = []
        for step in range(1, 30):
            value = rng.choice([None, float("nan"), float("inf"), *(round(rng.random(), 1) for _ in range(4))])
            new = saved(step, value, epoch=step // 3, batch_in_epoch=step % 3)
            history.append(new)
            on_disk.append(new)
            keep = kept(on_disk, policy, pinned=[step])
            on_disk = [s for s in on_disk if s.step in keep]
        assert {s.step for s in on_disk} == kept(history, policy), (trial, policy)


# ---- the manifest's field ------------------------------------------------------------------------
def test_the_metric_field_records_finite_values_only() -> None:
    assert mf.metric_field("val_loss", 0.25, 13) == {"name": "val_loss", "value": 0.25, "step": 13}
    assert mf.metric_field("val_loss", 3, 13) == {"name": "val_loss", "value": 3.0, "step": 13}
    for value in (float("nan"), float("inf"), None, True, "0.1", 10**400, torch.tensor(0.5)):
        assert mf.metric_field("val_loss", value, 13) == {"name": "val_loss", "value": None, "step": None}, value


def _manifest(tmp_path: Path, **fields: Any) -> Dict[str, Any]:
    m = CheckpointManager(tmp_path, Comm(), 3, {"a": 1}, lambda *a, **k: None)
    m.save(20, {"model": Box({"w": torch.zeros(2)})}, {}, {"epoch": 1, **fields})
    m.close()
    return json.loads((tmp_path / mf.step_dir_name(20) / mf.MANIFEST).read_text())


@pytest.mark.parametrize(
    "field",
    [
        {"name": "val_loss", "value": 0.5},  # no step
        {"name": "val_loss", "value": 0.5, "step": 21},  # logged after the checkpoint's step
        {"name": "val_loss", "value": 0.5, "step": None},
        {"name": "val_loss", "value": None, "step": 20},
        {"name": "val_loss", "value": "0.5", "step": 20},
        {"name": "val_loss", "value": True, "step": 20},
        {"name": "", "value": 0.5, "step": 20},
        {"name": 7, "value": 0.5, "step": 20},
        {"name": "val_loss", "value": 0.5, "step": 20, "mode": "min"},
        ["val_loss", 0.5, 20],
    ],
)
def test_a_bad_metric_field_makes_the_manifest_unusable(tmp_path: Path, field: Any) -> None:
    data = _manifest(tmp_path)
    where = tmp_path / mf.MANIFEST
    with pytest.raises(mf.ManifestError, match="'metric'"):
        mf.validate(mf.parse(mf.seal({**data, mf.METRIC: field}), where), where, 20)


def test_a_non_finite_value_in_a_sealed_manifest_is_refused_never_an_exception(tmp_path: Path) -> None:
    data = _manifest(tmp_path)
    where = tmp_path / mf.MANIFEST
    for value in (float("nan"), float("inf"), -float("inf"), 10**400):  # JSON's NaN, Infinity, a huge integer
        sealed = mf.seal({**data, mf.METRIC: {"name": "val_loss", "value": value, "step": 20}})  # its digest matches
        with pytest.raises(mf.ManifestError, match="'metric'"):
            mf.validate(mf.parse(sealed, where), where, 20)


def test_good_metric_fields_are_read_back(tmp_path: Path) -> None:
    fields = [
        {"name": "val_loss", "value": 0.5, "step": 20},
        {"name": "val loss/τ", "value": -3, "step": 0},
        mf.metric_field("val_loss", float("nan"), 20),
    ]
    for field in fields:
        _manifest(tmp_path, **{mf.METRIC: field})
        assert mf.read(tmp_path / mf.step_dir_name(20))[mf.METRIC] == field
    assert fields[2] == {"name": "val_loss", "value": None, "step": None}


def test_the_manager_keeps_the_best_on_disk_and_names_it(tmp_path: Path) -> None:
    """Real saves and real files: what is left is the rule's, read from the manifests alone."""
    m = CheckpointManager(tmp_path, Comm(), 1, {"a": 1}, lambda *a, **k: None, keep_best=2, monitor="val_loss", mode="min")
    values = {10: 0.9, 20: 0.4, 30: float("nan"), 40: 0.5, 50: None, 60: 0.8}
    for step, value in values.items():
        field = mf.metric_field("val_loss", value, step)
        m.save(step, {"model": Box({"w": torch.full((2,), float(step))})}, {}, {"epoch": step // 10, mf.METRIC: field})
    m.close()
    assert sorted(s for s, _ in mf.committed(tmp_path)) == [20, 40, 60]
    found = mf.best(mf.scan(tmp_path), m.retention)
    assert found is not None and found[0].step == 20 and found[1] == 0.4


def test_a_manager_without_a_monitor_keeps_what_it_kept_before(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, Comm(), 1, {"a": 1}, lambda *a, **k: None)
    for step in (10, 20, 30):
        m.save(step, {"model": Box({"w": torch.zeros(2)})}, {}, {mf.METRIC: mf.metric_field("val_loss", 1.0 / step, step)})
    m.close()
    assert [s for s, _ in mf.committed(tmp_path)] == [30]
    assert mf.best(mf.scan(tmp_path), m.retention) is None


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_keeps_the_newest_and_the_two_best_by_val_loss_and_resumes(tmp_path: Path) -> None:
    """The built-in trainer on 2 torchrun workers, 5 epochs, a checkpoint every epoch, keep_last=1 and
    keep_best=2 by val_loss (a high learning rate, so val_loss goes up and down), and rank 0 killed in
    epoch 4: the restart resumes from the newest checkpoint retention left. At the end the committed
    checkpoints are exactly the newest and the two best by the val_loss metrics.jsonl holds, each
    manifest records its epoch's val_loss, and summary.json names the best."""
    run_train(
        tmp_path,
        *QUICK,
        "trainer.max_epochs=5",
        "trainer.lr=0.5",
        "run.name=r",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=2",
        "checkpoint.monitor=val_loss",
        "fault=kill_rank",
        "fault.at_step=45",  # epoch 4 of 13 steps each
        "restart.max_restarts=1",
        check=True,
    )
    folder = run_dir(tmp_path, "r")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}  # the last row of a step wins
    assert sorted(val) == [13, 26, 39, 52, 65]
    best2 = sorted(val, key=lambda s: val[s])[:2]
    assert set(best2) != {52, 65}, f"precondition: val_loss must not fall every epoch here, to tell best from newest: {val}"
    assert committed_steps(folder) == sorted({65, *best2})
    for step in committed_steps(folder):
        recorded = mf.read(folder / "checkpoints" / mf.step_dir_name(step))[mf.METRIC]
        assert recorded == {"name": "val_loss", "value": val[step], "step": step}
    s = summary(folder)
    assert s["status"] == "completed" and s["restarts"] == 1 and s["resumed_from_step"] == 39
    assert s["best_checkpoint_step"] == best2[0] and math.isclose(s["best_checkpoint_value"], val[best2[0]])
    assert s["best_checkpoint"] == str(folder / "checkpoints" / mf.step_dir_name(best2[0]))
