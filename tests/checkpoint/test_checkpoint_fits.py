"""A checkpoint that parses but does not fit the live objects is unusable: it falls back before
anything is applied (#23 item 3); an orphaned worker never commits, right up to the rename (item 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from helpers import Box, Recorder, manager, model_state
from steadfast.checkpoint import manifest as mf
from steadfast.checkpoint.manager import CheckpointError
from steadfast.contract.events import Event


def _fits_test(tmp_path: Path, bad_objects: Dict[str, Any], bad_own: Dict[str, Any]) -> None:
    from steadfast.checkpoint.state import Progress, RNGState

    model = torch.nn.Linear(4, 3)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    m = manager(tmp_path, keep_last=3)
    m.save(1, {"model": model, "progress": Progress(global_step=1)}, {"rng": RNGState()}, {})
    m.wait()
    m.save(2, bad_objects, bad_own, {})
    m.close()
    events = Recorder()
    live, progress, rng = torch.nn.Linear(4, 3), Progress(), RNGState()
    restored = manager(tmp_path, events=events).restore({"model": live, "progress": progress}, {"rng": rng}, False)
    assert restored is not None and restored.step == 1
    assert all(torch.equal(v, good[k]) for k, v in live.state_dict().items()) and progress.global_step == 1
    assert events.of(Event.CHECKPOINT_INVALID) and events.of(Event.CHECKPOINT_SET_ASIDE)


def test_a_weight_reshaped_with_the_same_bytes_falls_back(tmp_path: Path) -> None:
    from steadfast.checkpoint.state import Progress, RNGState

    w = torch.nn.Linear(4, 3).state_dict()
    reshaped = Box({"weight": w["weight"].reshape(4, 3).clone(), "bias": w["bias"]})
    _fits_test(tmp_path, {"model": reshaped, "progress": Progress(global_step=2)}, {"rng": RNGState()})


def test_a_short_rng_state_falls_back_before_anything_is_applied(tmp_path: Path) -> None:
    from steadfast.checkpoint.state import Progress, RNGState

    short = Box({**RNGState().state_dict(), "torch": torch.zeros(10, dtype=torch.uint8)})
    _fits_test(tmp_path, {"model": torch.nn.Linear(4, 3), "progress": Progress(global_step=2)}, {"rng": short})


def test_a_progress_of_the_wrong_type_falls_back(tmp_path: Path) -> None:
    from steadfast.checkpoint.state import RNGState

    _fits_test(tmp_path, {"model": torch.nn.Linear(4, 3), "progress": Box({"global_step": "abc"})}, {"rng": RNGState()})


def test_the_orphan_fence_is_checked_right_before_the_rename_that_commits(tmp_path: Path) -> None:
    """The launcher may go after the last file is written and before the commit: an orphaned worker
    must not commit then either (the fence used to run only after each file)."""
    from steadfast.checkpoint.tracked import LauncherGone

    class Hooks:
        def __init__(self) -> None:
            self.calls: List[str] = []

        def during_save(self, step: int, files_written: int) -> None:
            self.calls.append("file")

        def before_commit(self, step: int) -> None:
            self.calls.append("commit")
            raise LauncherGone("the launcher is gone")

        def after_commit(self, step: int, path: Path) -> None:
            self.calls.append("after")

    hooks = Hooks()
    m = manager(tmp_path, hooks=hooks)
    with pytest.raises(CheckpointError, match="the launcher is gone"):
        m.save(1, model_state(1), {}, {})
    assert hooks.calls[-1] == "commit" and "after" not in hooks.calls
    assert not mf.committed(tmp_path) and not [p for p in tmp_path.iterdir() if p.name.startswith(mf.TMP_PREFIX)]
