"""A save's layout reused from the last save while the state keeps its structure (checkpoint/reuse.py):
it is reused when nothing but values changed, planned anew when anything else did, and what is
restored is exactly what was saved either way (real manager, real files, synchronous and asynchronous)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch

from helpers import Box
from steadfast.checkpoint.codec import OWN, SHARED
from steadfast.checkpoint.manager import CheckpointManager
from steadfast.checkpoint.replicated import ReplicatedCodec
from steadfast.checkpoint.reuse import Plans
from steadfast.distributed.comm import Comm


def same(a: Any, b: Any) -> bool:
    """Exactly equal: tensors by dtype, shape and bits; floats by bits (0.0 is not -0.0); types too."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return type(b) is float and a.hex() == b.hex()
    return type(a) is type(b) and a == b


def snapshot_of(obj: Any) -> Any:
    state = obj.state_dict()
    return copy.deepcopy({k: v.detach() for k, v in state.items()} if isinstance(obj, torch.nn.Module) else state)


def steps() -> List[Tuple[str, Callable[[Dict[str, Any]], None], bool]]:
    """(what changes before the save, the change, whether the last layout is reused)."""

    def train(s: Dict[str, Any]) -> None:
        s["model"](torch.randn(4, 3)).sum().backward()
        s["optimizer"].step()

    def values(s: Dict[str, Any]) -> None:
        train(s)
        s["extra"].state["lr"] = 0.5
        s["extra"].state["t"] = s["extra"].state["t"] + 1  # a new tensor object of the same shape

    def resized(s: Dict[str, Any]) -> None:
        s["extra"].state["t"] = torch.arange(7.0)

    def in_place_resize(s: Dict[str, Any]) -> None:
        s["extra"].state["t"].resize_(3)  # the same object, another shape

    def negative_zero(s: Dict[str, Any]) -> None:
        s["extra"].state["lr"] = -0.0 if s["extra"].state["lr"] == 0.0 else 0.0

    def int_for_float(s: Dict[str, Any]) -> None:
        s["extra"].state["lr"] = 1  # equal to 1.0 in Python, another value in the file
        s["extra"].state["count"] = True  # equal to 1

    def new_group(s: Dict[str, Any]) -> None:
        s["optimizer"].add_param_group({"params": [s["scale"]], "lr": 0.1})
        train(s)

    def dtype(s: Dict[str, Any]) -> None:
        s["extra"].state["t"] = s["extra"].state["t"].to(torch.float64)

    return [
        ("first save (no optimizer state yet)", lambda s: None, False),
        ("an optimizer's state appears", train, False),
        ("only values change", train, True),
        ("values, a scalar and a new tensor of the same shape", values, True),
        ("a tensor replaced by one of another shape", resized, False),
        ("the same tensor resized in place", in_place_resize, False),
        ("a float's sign (a value: the skeleton refilled)", negative_zero, True),
        ("an int for an equal float, a bool for an equal int", int_for_float, False),
        ("only values change again", train, True),
        ("a new param group", new_group, False),
        ("a tensor's dtype", dtype, False),
        ("only values change, once more", train, True),
    ]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_reused_layout_restores_exactly_and_any_structural_change_plans_anew(tmp_path: Path, async_save: bool) -> None:
    torch.manual_seed(0)
    blocks = [[torch.nn.Linear(3 if i == 0 else 4, 4), torch.nn.BatchNorm1d(4)] for i in range(10)]
    model = torch.nn.Sequential(*[layer for block in blocks for layer in block])  # 70 tensors: worth reusing
    scale = torch.nn.Parameter(torch.ones(2))
    s: Dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-2),
        "scale": scale,
        "extra": Box({"t": torch.arange(5.0), "lr": 0.0, "count": 1, "np": np.arange(3, dtype=np.int32)}),
    }
    m = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None, async_save=async_save)
    for step, (what, change, reused) in enumerate(steps(), start=1):
        change(s)
        objects = {"model": model, "optimizer": s["optimizer"], "extra": s["extra"]}
        rng = Box({"torch": torch.full((3,), step, dtype=torch.uint8), "numpy": ("MT", np.full(4, step), step, 0.5)})
        expected = {name: snapshot_of(obj) for name, obj in objects.items()}
        expected_rng = copy.deepcopy(rng.state)
        before = m.plans.reused
        m.save(step, objects, {"rng": rng}, {"epoch": 0})
        m.wait()
        assert m.plans.reused == before + reused, what
        targets = {name: Box() for name in objects}
        restored_rng = Box()
        got = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None).restore(targets, {"rng": restored_rng}, False)
        assert got is not None and got.step == step, what
        for name in objects:
            assert same(expected[name], targets[name].state), f"{what}: {name} differs"
        assert same(expected_rng, restored_rng.state), f"{what}: the per-rank state differs"
    m.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_small_state_is_reused_by_a_sync_save_and_planned_anew_by_an_async_one(tmp_path: Path, async_save: bool) -> None:
    """A synchronous save builds its header on the saving thread, which a reused layout keeps: a small
    state's layout is reused there too (and restores exactly, new tensors and values each save); an
    asynchronous save's blocking part plans a small state anew, without a walk."""
    m = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None, async_save=async_save)
    for step in (1, 2, 3):
        state = {"w": torch.full((3,), float(step)), "lr": 0.1 * step, "n": [step, "x"]}
        m.save(step, {"w": Box(copy.deepcopy(state))}, {}, {"epoch": 0})
        m.wait()
        target = Box()
        got = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None).restore({"w": target}, {}, False)
        assert got is not None and got.step == step and same(target.state, state), step
    m.close()
    assert m.plans.reused == (0 if async_save else 2)


def test_a_snapshot_reuses_its_layouts_and_takes_each_tensor_from_the_new_state() -> None:
    codec, plans = ReplicatedCodec(), Plans(small=0)  # every file, however small
    codec.plans = plans
    weights = torch.nn.Linear(3, 2)
    first = codec.snapshot({"m": weights.state_dict(keep_vars=True)}, {"rng": {"t": torch.zeros(2)}}, True)
    second = codec.snapshot({"m": weights.state_dict(keep_vars=True)}, {"rng": {"t": torch.ones(2)}}, True)
    assert plans.reused == 2  # the shared objects' layout and this rank's own
    assert second[SHARED].entries is first[SHARED].entries  # the same tensors: the entries as they were
    assert [torch.equal(e.tensor, torch.ones(2)) for e in second[OWN].entries] == [True]
    assert second[OWN].header() == first[OWN].header()
    codec.snapshot({"m": weights.state_dict(keep_vars=True)}, {"rng": {"t": torch.ones(3)}}, True)
    assert plans.reused == 3  # the shared objects' only: this rank's own tensor changed its shape


@pytest.mark.parametrize("change", ["data", "dtype", "replaced"])
def test_an_optimizer_tensor_changed_between_async_saves_is_found_in_the_background_and_restores_exactly(
    tmp_path: Path, change: str
) -> None:
    # an asynchronous save does not read the optimizer's tensors' dtypes and shapes while it blocks
    # (reuse.py): the layout is reused, checked in the background before they are copied, placed anew
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"p{i:02d}": torch.nn.Parameter(torch.randn(i + 1)) for i in range(80)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = Box({"t": torch.arange(5.0)})
    m = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None, async_save=True)
    objects = {"model": model, "optimizer": optimizer, "extra": extra}
    for step in (1, 2, 3, 4):
        if step == 3:
            with torch.no_grad():
                if change == "data":  # the same object, another shape: what the loop's walk does not see
                    model["p05"].data = torch.randn(9, 2)
                elif change == "dtype":
                    model["p40"].data = model["p40"].data.double()
                else:  # a new parameter of another shape in the module and the optimizer alike
                    new = torch.nn.Parameter(torch.randn(3, 3))
                    model["p70"] = new
                    optimizer.param_groups[0]["params"][70] = new
        expected = {name: snapshot_of(obj) for name, obj in objects.items()}
        before = m.plans.reused
        m.save(step, objects, {}, {"epoch": 0})
        m.wait()
        assert m.plans.reused == before + (step in (2, 3)), step  # step 3 reused, checked later; 4 planned anew
        targets = {name: Box() for name in objects}
        got = CheckpointManager(tmp_path, Comm(), 1, {}, lambda *a, **k: None).restore(targets, {}, False)
        assert got is not None and got.step == step
        for name in objects:
            assert same(expected[name], targets[name].state), f"step {step}: {name} differs"
    m.close()
